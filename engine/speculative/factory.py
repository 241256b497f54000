"""Building the speculator that `--spec` names, with its proposer's weights and checks."""
from __future__ import annotations

from pathlib import Path

from engine.config.engine_config import EngineConfig
from engine.errors import NInferError
from engine.model.formats import pick_kv_dtype, weight_format
from engine.model.linear import LOW_BIT
from engine.model.loader import load_weights
from engine.model.registry import build_model
from engine.speculative.draft import DraftModelProposer, check_same_tokenizer
from engine.speculative.mtp import MTPProposer, find_mtp
from engine.speculative.ngram import NgramProposer
from engine.speculative.speculator import Speculator
from engine.tokenizer import Tokenizer

METHODS = ("none", "ngram", "draft", "mtp")


def make_speculator(config: EngineConfig, *, target, runner, tokenizer, target_path: Path,
                    mtp_weights: dict | None = None) -> Speculator | None:
    """The speculator `config.spec` names (its draft_tokens, draft_model, lm_head_draft, weight_dtype), or None.
    target: the model being served; runner: its ModelRunner (the draft KV pool matches its page count)."""
    method, draft_tokens, lm_head_draft = config.spec, config.draft_tokens, config.lm_head_draft
    if method in ("none", "", None):
        return None
    if method == "ngram":
        return Speculator(NgramProposer(), draft_tokens)
    if method == "draft":
        return Speculator(_draft_proposer(target, runner, tokenizer, target_path, config.draft_model, lm_head_draft,
                                          config.weight_dtype, config.max_concurrency), draft_tokens)
    if method == "mtp":
        spec = find_mtp(mtp_weights or {}, target.cfg)
        if spec is None:
            raise NInferError(f"--spec mtp: {target_path.name} carries no multi-token-prediction (MTP) layers.",
                              "Use --spec ngram or --spec draft --draft-model PATH, or a checkpoint with MTP "
                              "tensors (mtp.* or num_nextn_predict_layers).")
        if not hasattr(target, "mtp_layer"):
            raise NInferError(f"--spec mtp: this engine cannot build the MTP layer of a {target.cfg.arch} model.",
                              "Use --spec ngram or --spec draft --draft-model PATH.")
        return Speculator(MTPProposer(target, runner, spec, lm_head_draft), draft_tokens)
    raise NInferError(f"--spec {method} is not available in this version.",
                      f"Use one of: {', '.join(METHODS)}.")


def _draft_proposer(target, runner, tokenizer, target_path: Path, draft_model: str | None, lm_head_draft: bool,
                    weight_dtype: str, max_sequences: int):
    if not draft_model:
        raise NInferError("--spec draft needs a draft model.", "Set --draft-model PATH (a GGUF file or model folder "
                                                               "of the same family), or use --spec ngram.")
    native = weight_dtype == "auto" or weight_dtype in LOW_BIT
    path, weights = load_weights(draft_model, native=native)
    draft_tok = Tokenizer.from_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)
    check_same_tokenizer(tokenizer, draft_tok, target_path.name, path.name)
    fmt = weight_format(weight_dtype, weights)
    model = build_model(weights, target.dtype, target.device, fmt)
    kv = pick_kv_dtype("auto", target.device)
    return DraftModelProposer(model, runner.pool.num_pages, kv, lm_head_draft, runner.page_size, max_sequences)
