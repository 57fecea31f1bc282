"""`gradaccum bench` on pretraining rows: config, data, loops (the contestants), measure,
report."""
