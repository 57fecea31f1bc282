"""Data for training: token streams and their batches, tokenizers and supervised fine-tuning
(SFT) examples.

- `tokens`: `load_tokens`, the built-in corpus (`corpus`) or the user's token files, split
  into training and held-out sequences; `batches`: those sequences in micro-batches
  (`Batches`, `eval_batches`); `hf_datasets`: `--data hf:NAME` from the local datasets cache
  and folders written by save_to_disk, for pretraining text and SFT rows alike;
- `tokenizers`: the interface the trainer tokenizes through, the built-in byte tokenizer and a
  Hugging Face tokenizer read from a local folder, with their chat templates;
- `sft_rows`: SFT rows read from .jsonl / .json / .parquet, a save_to_disk folder or the
  local datasets cache, and the format of each (prompt/completion, messages, Alpaca);
- `sft_examples`: rows tokenized into input ids and labels (-100 on what is not a target);
- `sft`: the two together (`load_sft`), with the counts and length distribution of a data set;
- `sft_batches`: examples into windows of micro-batches (per step in examples or in tokens),
  split over ranks, resumable; the held-out split;
- `sft_tasks`: the built-in instruction set generated from a seed, with its answer checker;
- `sft_eval`: exact match by greedy generation and the held-out loss over completion tokens.

Nothing is imported here. Reading and tokenizing (tokenizers, sft_rows, sft_examples, sft,
sft_tasks) need numpy only, transformers only for a Hugging Face tokenizer (imported when one
is loaded); batching and evaluation (sft_batches, sft_eval) need torch.
"""
