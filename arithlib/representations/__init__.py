"""Beyond the three papers: how the numbers themselves are represented (notebook 09):
Fourier features (Zhou et al. 2024) and the helix (Kantamneni & Tegmark 2025), and whether
Nikankin's heuristic neurons read them."""
