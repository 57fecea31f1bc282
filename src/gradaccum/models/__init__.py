"""Models shared by train, fit, verify and bench: Hugging Face causal-LM folders read from
disk, their export back into folders transformers and peft load, and LoRA adapters.

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
