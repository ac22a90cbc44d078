"""`engines.sglang_args`: SGLang's server arguments as a JSON object, checked by name, and the GPUs they take."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.sglang_args import check_server_args, engine_gpus, parse_server_args

FIELDS = frozenset({"tp_size", "dp_size", "pp_size", "mem_fraction_static", "context_length", "enable_dp_attention"})


def test_a_json_object_and_nothing_else() -> None:
    assert parse_server_args('{"tp_size": 2, "mem_fraction_static": 0.8}') == {"tp_size": 2, "mem_fraction_static": 0.8}
    assert parse_server_args("") == {}
    for bad in ("[1]", "2", "{tp_size: 2}"):
        with pytest.raises(ValueError, match="JSON object"):
            parse_server_args(bad)


def test_unknown_and_reserved_names_are_refused_by_name() -> None:
    assert check_server_args({"tp_size": 2}, FIELDS) == {"tp_size": 2}
    with pytest.raises(ValueError) as refused:
        check_server_args({"tp_sise": 2, "model_path": "/m", "context_length": 9}, FIELDS)
    message = str(refused.value)
    assert "tp_sise: not a server argument of this SGLang (did you mean tp_size" in message
    assert "model_path: set by Weir" in message and "context_length" not in message
    assert check_server_args({"anything": 1}, None) == {"anything": 1}  # no SGLang here: its names are unknown


def test_gpus_per_engine_follow_sglangs_world_size() -> None:
    assert engine_gpus({}) == 1
    assert engine_gpus({"tp_size": 4}) == 4
    assert engine_gpus({"tp_size": 2, "pp_size": 2, "dp_size": 2}) == 8
    assert engine_gpus({"tp_size": 4, "dp_size": 4, "enable_dp_attention": True}) == 4  # DP ranks inside TP
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        engine_gpus({"tp_size": 0})


def test_the_architectures_sglang_serves_are_read_from_its_model_modules(tmp_path: Path) -> None:
    from engines.sglang_args import served_architectures, unserved_refusal

    (tmp_path / "one.py").write_text("class A: ...\n\nEntryClass = A\n")
    (tmp_path / "many.py").write_text("EntryClass = [\n    B,\n    C,\n]\n")
    (tmp_path / "none.py").write_text("x = 1  # EntryClass = D only in a comment\n")
    served = served_architectures(tmp_path)
    assert served == frozenset({"A", "B", "C"})
    assert unserved_refusal(["C"], {}, served) is None
    assert unserved_refusal(["E"], {"model_impl": "transformers"}, served) is None  # SGLang's own fallback
    assert unserved_refusal(["E"], {}, None) is None  # sglang not installed: its import fails at start instead
    said = unserved_refusal(["E"], {}, served)
    assert said is not None and "a E, which the installed SGLang has no model for" in said
    assert "WEIR_BACKEND=transformers" in said and '"model_impl": "transformers"' in said
