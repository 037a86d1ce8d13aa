"""eslm: risk-averse selective language modeling (ESLM) for GPT-style pretraining.

Import is cheap: no submodule with heavy work is loaded here.
"""

__version__ = "0.1.0"
