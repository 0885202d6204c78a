"""Small builders shared by the training tests."""

from __future__ import annotations


def tiny_job(corpus_dir: str, run_dir: str, **sections) -> dict:
    """Overrides for a fast debug-model run on the session corpus (fp32, CPU).

    ``sections`` maps a section name to a dict of its keys, merged over the defaults."""
    job = {
        "model": {"preset": "debug", "vocab_size": 512, "n_layers": 2, "dim": 64,
                  "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 160},
        "train": {"steps": 10, "seed": 7, "global_batch": 8, "micro_batch": 2,
                  "seq_len": 32, "lr": 3e-3, "warmup_steps": 2, "grad_clip": 1.0,
                  "log_interval": 1000},
        "data": {"max_bytes": 1_000_000, "vocab_size": 512, "cache_dir": corpus_dir},
        "run": {"dir": run_dir},
    }
    for name, keys in sections.items():
        job.setdefault(name, {}).update(keys)
    return job


def relative_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
