"""A run's folder: what it writes as it goes (`outputs`, `metrics`, `tensorboard`), its
checkpoints (`checkpoint`, `payload`), how a resume reads them back (`resume`), the lock that
keeps one run per folder (`lock`), and its settings (`settings`: config.yaml)."""
