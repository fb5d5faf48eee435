"""Figures from tables, one module per study: each function takes the DataFrame a notebook
also saves as CSV and returns a matplotlib Figure (saving: :func:`arithlib.outputs.save_figure`).

``accuracy`` (notebook 00), ``heads`` (01), ``probing`` (02), ``neurons`` (03), ``cna`` (04),
``finetune`` (05, 08), ``pruning`` (06), ``bias`` (07), ``report`` (the cross-model figure)."""
