"""`gradaccum bench --task sft`: config, data, loops (gradaccum's packings, TRL, the
Trainer), measure, report."""
