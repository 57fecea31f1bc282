"""RL fine-tuning of the GRPO family: its settings (`settings`, no torch), sampling the
completions (`sampling`), the rewards (`rewards`). The losses are `gradaccum.rl`."""
