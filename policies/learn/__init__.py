"""Learners: SB3 (PPO, DQN), DAgger imitation, BC, the oracle expert, Minari datasets, runs, Ray Tune."""
