"""The paper's own numbers (Ye et al., ICLR 2025, arXiv 2410.05258), for columns labelled as the paper's.

3B-parameter models trained on 350B tokens; statistics over 0.4M tokens. Figure 8 values are approximate
readings of a plot, not published numbers.
"""

from __future__ import annotations

SOURCE = "Ye et al., Differential Transformer, ICLR 2025 (arXiv 2410.05258)"
TABLE5_COLUMNS = ("Top-1", "Top-2", "Top-3", "Top-10", "Top-100", "Median")

# Table 5: largest |activation| values; kind -> activation -> the six columns above.
TABLE5 = {
    "standard": {
        "attention_logits": (318.0, 308.2, 304.9, 284.7, 251.5, 5.4),
        "hidden_states": (3608.6, 3607.4, 3603.6, 3552.1, 2448.2, 0.6),
    },
    "diff": {
        "attention_logits": (38.8, 38.8, 37.3, 32.0, 27.4, 3.3),
        "hidden_states": (1688.2, 1672.5, 1672.1, 1624.3, 740.9, 1.2),
    },
}

# Figure 8: zero-shot HellaSwag accuracy (%) with attention logits absmax-quantized; read from the plot (±2 points).
FIGURE8_BITS = (16, 8, 6, 4)
FIGURE8 = {"standard": (65.0, 65.0, 50.0, 40.0), "diff": (65.0, 65.0, 65.0, 60.0)}
