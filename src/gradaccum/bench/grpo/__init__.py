"""`gradaccum bench --task grpo`: gradaccum's RL losses against TRL's GRPOTrainer on one window
of sampled completions: for each loss type both contestants' update error against the float64
big batch, and completion tokens/s of the training part, generation timed apart."""
