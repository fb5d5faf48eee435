"""arithlib: the helper library behind the notebooks that reproduce three papers on
how language models do arithmetic (Zhang et al. 2024; Yu & Ananiadou 2024;
Nikankin et al. 2025). Notebooks orchestrate and plot; every computation is here."""

__version__ = "1.0.0"
