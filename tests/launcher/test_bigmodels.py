"""Models bigger than one rank, under every backend's real launcher, 2 processes on the CPU
(``tests/support/bigmodels_worker.py``: one launch per backend case runs every section).

- ``meta``: built under ``parallelx.init_module()`` = built eagerly from the same seed, **bitwise**,
  after set-up and after one AdamW step (the suite's nanoGPT-style GPT with its tied embedding, and a
  model with a rotary ``inv_freq`` buffer, a ``nn.Parameter(torch.randn(...))``, ``trunc_normal_`` and
  ``kaiming_normal_`` inits and BatchNorm buffers); tied weights stay tied; the random stream after
  the build is the eager one.
- ``plain``: a plain ``torch.device("meta")`` build of torch.nn's layers (an attention's
  ``_reset_parameters``, BatchNorm, a tied head) = the eager build, **bitwise**, from the modules'
  ``reset_parameters`` alone and with the model's ``init_weights`` given to ``parallelx.init_weights``;
  a model whose ``__init__`` makes values no reset gives is a ``ParallelxError`` naming those tensors
  and ``parallelx.init_module()``.
- ``load``: ``parallelx.load_pretrained`` of a meta-built GPT from a ``torch.save`` file, the same
  with ``module._orig_mod.`` prefixes, a ``.safetensors`` file and a Hugging Face folder (two shards
  and their index), tied ``lm_head.weight`` stored once = the eager model loaded with
  ``load_state_dict`` and set up, **bitwise**; the bytes each rank read: under fsdp and ZeRO-3 its
  share (the two ranks' reads sum to the file, each at most 0.55 of it: a partition's rows are rounded
  up to whole rows, scalars are read by both), elsewhere the whole file once per process; nothing read
  before set-up.  Wrong names and shapes: one error naming all three; ``strict=False`` loads the rest.
- ``save``: a ``transformers`` GPT-2 (a small config, tied embeddings) trained one AdamW step on the
  backend, saved with ``parallelx.save_pretrained`` as one ``model.safetensors`` and as four shards
  with their index (``max_shard_size="40KB"``), loads with ``GPT2LMHeadModel.from_pretrained``: the
  same weights and the same logits as the trained model (measured: a difference of exactly 0 on every
  backend, the same weights through the same CPU kernels), the tied embedding stored once.

No tolerance: every comparison is ``torch.equal``.
"""

from __future__ import annotations

import pytest
from launching import backend_cases, deepspeed_together, in_make_test, worker_reports

CASES = backend_cases()
#: The cases whose ranks keep a share of each parameter (and so read only that).
SHARDING = {"fsdp", "deepspeed-zero3"}

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(900)]


# make test runs the cases that shard (and ddp, the reference); the others are scenarios (CI runs both).
@pytest.fixture(
    scope="module",
    params=in_make_test(CASES, "fsdp"),
    ids=list(CASES),
)
def reports(request, tmp_path_factory) -> list[dict]:
    found = worker_reports(
        request.param, CASES, "bigmodels_worker.py", tmp_path_factory, timeout=500, together=deepspeed_together(CASES)
    )
    for rep in found:
        rep["case"] = request.param
    return found


def assert_bitwise(name: str, r: dict) -> None:
    assert r["built_on_meta"], name
    assert r["rng_after_build_equal"], name
    assert r["tensors"] > 0
    assert r["mismatched"] == [], (name, r["mismatched"])
    assert r["buffers_mismatched"] == [], (name, r["buffers_mismatched"])
    assert r["step_changed"], name  # the step did something, so the next check can fail
    assert r["after_step_mismatched"] == [], (name, r["after_step_mismatched"])


def test_set_up_leaves_the_engine_for_the_first_forward_and_a_one_rank_read_waits_for_nothing(reports):
    for rep in reports:
        r = rep["setup"]
        if rep["case"] == "deepspeed-zero3":
            # Set-up holds the partitions only; a scheduler and rank 0's read of the lr build nothing
            # (a build on one rank would wait for the other in DeepSpeed's collectives: a timeout).
            assert (r["after_setup"], r["after_scheduler_and_lr"], r["after_step"]) == (False, False, True), r
            assert r["masters_shared"] and all(r["masters_shared"]), r  # no float32 copy of float32 weights
        assert r["same_groups"], r  # the scheduler's groups are the update's
        assert r["lr_after"] == pytest.approx(5e-3), r
    assert [rep["setup"]["lr"] for rep in reports if "lr" in rep["setup"]] == [pytest.approx(1e-2)]  # rank 0's


def test_meta_build_equals_the_eager_build_bitwise(reports):
    for rep in reports:
        for name, r in rep["meta"].items():
            if isinstance(r, dict):
                assert_bitwise(name, r)
        assert "rot.inv_freq" in rep["meta"]["rotary"]["buffers"]  # the non-persistent buffer was compared
        assert rep["meta"]["gpt"]["tied"] == [True, True]


def test_a_plain_meta_build_equals_the_eager_build_from_reset_parameters_and_init_weights(reports):
    for rep in reports:
        for name in ("reset", "init"):
            assert_bitwise(name, rep["plain"][name])
            assert rep["plain"][name]["tied"] == [True, True]
            assert "norm.running_var" in rep["plain"][name]["buffers"]


def test_a_plain_meta_build_with_values_no_reset_gives_is_refused_naming_them(reports):
    for rep in reports:
        assert "refused" in rep["plain"], rep["plain"]
        message = rep["plain"]["refused"]
        assert "parallelx.init_module()" in message and "gain" in message and "rot.inv_freq" in message, message


def test_pretrained_weights_load_into_the_shards_bitwise_reading_each_ranks_share(reports):
    kinds = ("torch", "prefixed", "safetensors", "folder")
    for kind in kinds:
        per_rank = [rep["load"][kind] for rep in reports]
        for r in per_rank:
            assert r["mismatched"] == [], (kind, r["mismatched"])
            assert r["loaded"], kind  # the file's values, not the build's
            assert r["read_before_setup"] == 0
        total = per_rank[0]["file_bytes"]
        reads = [r["bytes_read"] for r in per_rank]
        if reports[0]["case"] in SHARDING:
            assert total <= sum(reads) <= 1.1 * total, (kind, reads, total)
            assert max(reads) <= 0.55 * total, (kind, reads, total)
        else:
            assert reads == [total, total], (kind, reads, total)


def test_wrong_names_and_shapes_are_one_error_and_strict_false_loads_the_rest(reports):
    for rep in reports:
        error = rep["load"]["bad"]["error"]
        for name in ("transformer.wpe.weight", "transformer.ln_f.weight", "extra.weight"):
            assert name in error, (name, error)
        assert rep["load"]["lenient"] == {"wpe_from_init": True, "wte_loaded": True}


def test_saved_safetensors_load_with_from_pretrained_to_the_same_logits(reports):
    rep = reports[0]["save"]  # rank 0 loads what all ranks wrote
    assert rep["step_changed"]
    for kind, files in (("single", 1), ("sharded", 4)):
        r = rep[kind]
        assert len(r["files"]) == files and r["index"] == (files > 1), r
        assert r["weights_mismatched"] == [], r["weights_mismatched"]
        assert r["logits_scale"] > 0.1
        assert r["logits_max_abs_diff"] == 0.0, r
        assert r["wte_stored"] and not r["lm_head_stored"] and r["tied_after_load"], r
