"""The joint (k, expert cap) action: fixed-cap wrappers, the joint policy, its learner."""
