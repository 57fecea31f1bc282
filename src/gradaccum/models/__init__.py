"""Models shared by train, fit, verify and bench: the built-in GPT, Hugging Face causal LMs
built from a config or read from a folder, their export, LoRA adapters, the loss and the
optimizer.

- `gradaccum.models.gpt`: the built-in GPT (presets: `gradaccum.utils.choices.BUILTIN_MODELS`);
  `moe`: its mixture-of-experts layer; `router`: router logits of the built-in GPT and of
  Hugging Face MoE models, and the top-k counts the load-balancing loss is made of.
- `gradaccum.models.build`: `build_model`, from a preset, a Hugging Face config or a folder;
  `info`: `ModelInfo`, what was built; `hf_config`: a Hugging Face model from its config.
- `gradaccum.models.loss`: the token-sum causal-LM loss (`token_sum_loss`, `causal_lm_loss`;
  `gradaccum.hf.loss_fn` for Hugging Face's unshifted labels).
- `gradaccum.models.optimizer`: `adamw`, the one AdamW factory.
- `gradaccum.models.checkpointing`: activation checkpointing switched on and off one way.
- `gradaccum.models.hf_folder`: what a local Hugging Face folder holds (config.json, single or
  sharded safetensors, pytorch_model.bin) and loading it with nothing downloaded.
- `gradaccum.models.export`: `save_pretrained` into a folder written aside and swapped into
  place, the tokenizer files beside the weights.
- `gradaccum.models.lora`: LoRA on a frozen base (peft, the `lora` extra): applying it, the
  adapters' own state, their export (adapter folder and merged model), and the trainable
  parameter count of an architecture for planning.

Nothing is imported here: torch, transformers and peft load only with the module that needs
them.
"""
