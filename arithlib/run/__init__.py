"""The run machinery: a notebook's run (:mod:`.runs`), stored results and their fingerprints
(:mod:`.stored`, :mod:`.fingerprints`, :mod:`.sources`), output tables and figures
(:mod:`.outputs`), folders (:mod:`.paths`), the software environment (:mod:`.environment`),
the scales of the fine-tuning notebooks (:mod:`.scales`) and atomic file writes
(:mod:`.atomic`)."""
