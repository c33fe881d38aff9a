"""Rendering of the environments: one text line (``"ansi"``) or a bar strip of the recent rounds (``"rgb_array"``).

The ``"rgb_array"`` frame is a ``FRAME_SHAPE = (64, 128, 3)`` uint8 image of the last
``FRAME_ROUNDS = 32`` rounds of one generation, oldest on the left, one 4-pixel column per round
(3 pixels of bar, 1 of gap). For each round a grey bar of height proportional to the budget ``k``
(full height = ``kmax``), and over it a green bar proportional to the accepted drafts; a dark
baseline pixel marks that the round happened (so plain AR steps, k = 0, show as a dot). Drawing is
numpy only and happens in ``render()``; ``step()`` only appends (k, accepted) to a small ring
buffer, and not at all when ``render_mode`` is None.
"""

from __future__ import annotations

import numpy as np

#: Render modes of every specenv environment.
RENDER_MODES = ("ansi", "rgb_array")
#: Rounds shown in an ``"rgb_array"`` frame.
FRAME_ROUNDS = 32
#: Shape (height, width, channels) of an ``"rgb_array"`` frame.
FRAME_SHAPE = (64, 4 * FRAME_ROUNDS, 3)

_BACKGROUND = (255, 255, 255)
_BUDGET = (176, 176, 176)
_ACCEPTED = (46, 139, 87)
_BASELINE = (48, 48, 48)


def check_render_mode(render_mode: str | None) -> str | None:
    """Validate a ``render_mode`` argument.

    Raises:
        ValueError: Naming the argument when it is not None or one of :data:`RENDER_MODES`.
    """
    if render_mode is not None and render_mode not in RENDER_MODES:
        raise ValueError(f"render_mode={render_mode!r}: expected None or one of {RENDER_MODES}")
    return render_mode


class RoundStrip:
    """The last :data:`FRAME_ROUNDS` rounds (k, accepted) of ``n`` streams, and their frames.

    Args:
        kmax: Largest budget (full bar height).
        n: Number of streams (1 for a single environment).

    Example:
        >>> strip = RoundStrip(kmax=8)
        >>> strip.push(4, 2)
        >>> frame = strip.frames()[0]
        >>> frame.shape, frame.dtype
        ((64, 128, 3), dtype('uint8'))
        >>> int((frame[:, -4] == (46, 139, 87)).all(axis=1).sum())  # accepted bar: 2/8 of 63 rows
        15
    """

    def __init__(self, kmax: int, n: int = 1):
        self.kmax = int(kmax)
        self.n = int(n)
        # column FRAME_ROUNDS - 1 is the newest round; -1 marks "no round"
        self.k = np.full((self.n, FRAME_ROUNDS), -1, dtype=np.int64)
        self.accepted = np.full((self.n, FRAME_ROUNDS), -1, dtype=np.int64)

    def clear(self, mask: np.ndarray | None = None) -> None:
        """Forget the rounds of the streams in ``mask`` (all when None): a new generation starts."""
        m = slice(None) if mask is None else np.asarray(mask, dtype=bool)
        self.k[m] = -1
        self.accepted[m] = -1

    def push(self, k: int | np.ndarray, accepted: int | np.ndarray) -> None:
        """Append one round to every stream (scalars for a single stream, arrays of length n)."""
        self.k[:, :-1] = self.k[:, 1:]
        self.accepted[:, :-1] = self.accepted[:, 1:]
        self.k[:, -1] = k
        self.accepted[:, -1] = accepted

    def frames(self) -> np.ndarray:
        """``(n, *FRAME_SHAPE)`` uint8 images of every stream's recent rounds."""
        height, width, _ = FRAME_SHAPE
        col = np.arange(width) // 4  # round shown by each pixel column
        bar = (np.arange(width) % 4) != 3  # the 4th pixel of each round is a gap
        k = self.k[:, col]  # (n, width)
        a = self.accepted[:, col]
        present = (k >= 0) & bar
        span = height - 1  # pixel rows above the baseline
        hk = np.where(present, 1 + (np.maximum(k, 0) * span) // self.kmax, 0)
        ha = np.where(present, 1 + (np.maximum(a, 0) * span) // self.kmax, 0)
        level = np.arange(height - 1, -1, -1)[None, :, None]  # height above the bottom row, per image row
        img = np.empty((self.n, height, width, 3), dtype=np.uint8)
        img[:] = _BACKGROUND
        img[(level < hk[:, None, :]) & (level >= 1)] = _BUDGET
        img[(level < ha[:, None, :]) & (level >= 1)] = _ACCEPTED
        img[(level == 0) & present[:, None, :]] = _BASELINE
        return img
