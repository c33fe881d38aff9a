"""Figures published by the seed paper ("The Limits of Speculation"), and the profile derived from them.

The numbers are transcribed in ``../shared/reference/*.csv`` (Tables 4, A3-A6); they are repeated here
so the package carries them without that folder. Only published numbers live in this module; the
choices made to fill gaps (K=7,9,10 and the AR step) are functions with their rule in the docstring.
"""

from __future__ import annotations

import numpy as np

#: Qwen3-Coder-30B-A3B routing facts.
N_LAYERS = 48
N_EXPERTS = 128
TOP_K = 8

#: Table 4 (Table A1): median unique experts per verification pass, by m = K+1.
TABLE4_MEDIAN_U: dict[int, float] = {2: 12.1, 3: 15.5, 4: 18.2, 5: 20.6, 6: 22.6, 7: 24.5}
#: Table 4: median target time T_T (ms) by K.
TABLE4_MEDIAN_TT: dict[int, float] = {1: 8.98, 2: 10.81, 3: 12.63, 4: 10.94, 5: 11.51, 6: 12.07}
#: Table 4: median context L by K.
TABLE4_MEDIAN_L: dict[int, float] = {1: 605, 2: 606, 3: 605, 4: 605, 5: 600, 6: 591}

#: Table A4 (+ the K=8 row of Table A7): per-K OLS T_T = beta0 + alpha*U_r + c*L.
#: K -> (alpha ms/expert, c ms/token, beta0 ms, R2, OOS MAPE %); R2/MAPE are None where unpublished.
TABLE_A4: dict[int, tuple[float, float, float, float | None, float | None]] = {
    1: (0.0839, 0.001098, 7.294, 0.9896, 0.44),
    2: (0.0824, 0.001101, 8.854, 0.9806, 0.51),
    3: (0.0779, 0.001106, 10.532, 0.9669, 0.59),
    4: (0.2675, 0.001099, 4.739, 0.9977, 0.33),
    5: (0.2664, 0.001103, 4.780, 0.9982, 0.32),
    6: (0.2654, 0.001106, 4.881, 0.9985, 0.30),
    8: (0.2643, 0.0011022, 4.938, None, None),
}

#: Table A6: pooled model forms, (R2, CV RMSE ms, CV MAPE %).
TABLE_A6: dict[str, tuple[float, float, float]] = {
    "U_r + L": (0.856, 0.685, 4.42),
    "U_r + L + gamma*K": (0.861, 0.675, 4.33),
    "U_r x C(K) + L": (0.999, 0.056, 0.37),
}

#: Figure A6: draft (EAGLE-3 head) time T_D = D1*K + D0 ms.
DRAFT_D1 = 0.459
DRAFT_D0 = 0.073

#: Tables A3/A5 categories with their pooled round counts (used as mixture weights).
CATEGORY_ROUNDS: dict[str, int] = {
    "code_math": 326429,
    "qa": 75787,
    "rag": 63141,
    "math_reasoning": 57788,
    "coding": 47116,
    "stem": 42275,
    "translation": 16594,
    "extraction": 5839,
}

#: Generation settings of the paper's runs.
MAX_NEW_TOKENS = 1000
GENERATIONS_PER_RUN = 641


def profile_coefficients(kmax: int = 10) -> dict[int, tuple[float, float, float]]:
    """Per-K (beta0, alpha, c) of the paper profile for K = 0..kmax.

    Rules for budgets the paper does not publish:

    * K = 1..6 and 8: Table A4 as printed.
    * K = 7 and K >= 9: a least-squares line in K through the m >= 5 regime (K = 4, 5, 6, 8), for
      each of alpha, beta0 and c separately, evaluated at K ("interpolated from the m >= 5 regime").
    * K = 0 (plain autoregressive step, m = 1): the paper ran no K = 0 round. beta0 is extended
      linearly from the low-m regime (K = 1..3) to K = 0; alpha and c are that regime's means.

    Args:
        kmax: Largest budget to return.

    Returns:
        Mapping K -> (beta0 ms, alpha ms/expert, c ms/token).
    """
    out: dict[int, tuple[float, float, float]] = {}
    hi = np.array([4, 5, 6, 8], dtype=float)
    a_hi = np.polyfit(hi, [TABLE_A4[int(k)][0] for k in hi], 1)
    c_hi = np.polyfit(hi, [TABLE_A4[int(k)][1] for k in hi], 1)
    b_hi = np.polyfit(hi, [TABLE_A4[int(k)][2] for k in hi], 1)
    lo = np.array([1, 2, 3], dtype=float)
    b_lo = np.polyfit(lo, [TABLE_A4[int(k)][2] for k in lo], 1)
    out[0] = (
        float(np.polyval(b_lo, 0.0)),
        float(np.mean([TABLE_A4[int(k)][0] for k in lo])),
        float(np.mean([TABLE_A4[int(k)][1] for k in lo])),
    )
    for k in range(1, kmax + 1):
        if k in TABLE_A4:
            a, c, b = TABLE_A4[k][:3]
            out[k] = (b, a, c)
        else:
            out[k] = (float(np.polyval(b_hi, k)), float(np.polyval(a_hi, k)), float(np.polyval(c_hi, k)))
    return out
