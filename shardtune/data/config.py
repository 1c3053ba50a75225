"""The data section of a training config: where the rows come from and how they become token sequences."""

from __future__ import annotations

from dataclasses import dataclass

DATA_FORMATS = ("auto", "chat", "prompt_completion", "alpaca", "text")


@dataclass
class DataConfig:
    """Data settings, named as in TRL's SFT recipes and the Hugging Face PEFT examples."""

    dataset_name: str | None = None  # a local file or folder, a saved `datasets` folder, or a hub name
    dataset_config_name: str | None = None  # the hub data set's configuration (subset)
    splits: str = "train,test"  # names containing "train" train; the others evaluate
    dataset_text_field: str = "text"  # the column of raw-text rows
    data_format: str = "auto"  # auto | chat | prompt_completion | alpaca | text
    chat_template_format: str = "none"  # none: the tokenizer's template; chatml, llama-3, mistral, alpaca, zephyr
    add_special_tokens: bool = False  # add the named template's special tokens to the tokenizer
    append_concat_token: bool = False  # when packing, end every document with EOS (untrained) if it does not already
    max_seq_len: int = 2048
    packing: bool = False
    group_by_length: bool = False  # unpacked rows: each batch holds rows of about one length (less padding)
    train_on_prompt: bool = False  # also train on system/user/prompt tokens
    eval_split_ratio: float = 0.0  # hold out this fraction of train rows for eval when no eval split exists
    dataset_num_proc: int | None = None  # processes that tokenise (None: one)
    skip_bad_rows: bool = False  # drop malformed rows and count them instead of stopping

    def validate(self) -> list[str]:
        """Every problem with these settings, one line each (empty when they are fine)."""
        from shardtune.data.templates import TEMPLATES

        problems = []
        if not self.dataset_name:
            problems.append("dataset_name is missing: give a JSONL/JSON/Parquet/CSV file or folder, a saved "
                            "`datasets` folder or a hub name.")
        if self.data_format not in DATA_FORMATS:
            problems.append(f"data_format '{self.data_format}' is unknown: choose one of {', '.join(DATA_FORMATS)}.")
        names = ("none",) + tuple(TEMPLATES)
        if self.chat_template_format not in names:
            problems.append(f"chat_template_format '{self.chat_template_format}' is unknown: choose one of "
                            f"{', '.join(names)}.")
        if self.add_special_tokens and self.chat_template_format == "none":
            problems.append("add_special_tokens needs a named chat_template_format (chatml, llama-3, ...): the "
                            "tokenizer's own template already has its tokens.")
        if self.group_by_length and self.packing:
            problems.append("group_by_length groups unpacked rows by length, and packed rows all have max_seq_len "
                            "tokens: set packing false to group, or leave group_by_length out.")
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            problems.append(f"max_seq_len must be an integer of at least 2 (got {self.max_seq_len!r}).")
        if not 0.0 <= self.eval_split_ratio < 1.0:
            problems.append(f"eval_split_ratio must be in [0, 1) (got {self.eval_split_ratio!r}).")
        if self.dataset_num_proc is not None and self.dataset_num_proc < 1:
            problems.append(f"dataset_num_proc must be at least 1 or unset (got {self.dataset_num_proc!r}).")
        split_names = [s.strip() for s in self.splits.split(",") if s.strip()]
        if not any("train" in s for s in split_names):
            problems.append(f"splits '{self.splits}' names no train split: include one whose name contains "
                            "'train' (e.g. train,test).")
        if not self.dataset_text_field:
            problems.append("dataset_text_field is empty: name the column of raw-text rows (default: text).")
        return problems

    def train_split_names(self) -> list[str]:
        return [s.strip() for s in self.splits.split(",") if "train" in s.strip()]

    def eval_split_names(self) -> list[str]:
        return [s.strip() for s in self.splits.split(",") if s.strip() and "train" not in s.strip()]
