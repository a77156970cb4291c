"""`megaloom train` under torchrun (gloo), and `Trainer` in one started world for the MoE layouts: parallel runs
reproduce the single process, and their layout-free checkpoints resume under another layout and feed
single-process generation."""

import json
import subprocess
import sys

import pytest
import torch

from megaloom.config import load_config
from megaloom.train import train
from tests.conftest import tiny_overrides

from .expert_worlds import suite_expert_trainer_world4
from .harness import run_world


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def metric(run_dir, key):
    return {r["step"]: r[key] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def final_weights(run_dir):
    from megaloom.generate import load_for_generation

    model, _ = load_for_generation(run_dir, torch.device("cpu"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def torchrun(nproc: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "megaloom", "train", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("ref")
    cfg = load_config(None, tiny_overrides(small_corpus, run, "train.steps=10", "train.micro_batch_size=2",
                                           "train.grad_clip=0.5", "checkpoint.every=5"))
    train(cfg)
    return losses(run)


def test_tp_sp_and_tp_dp_match_single_process_then_reshard(small_corpus, tmp_path, reference):
    base = ["train.steps=10", "train.micro_batch_size=2", "train.grad_clip=0.5", "checkpoint.every=5"]
    # tp=2 with sequence parallelism, and tp=2 x dp=2, against the single process (clipping active: gnorm ~1)
    # (tp2 and dp2z1 with the weight gradients fused into the buckets, train.grad_accum_fusion: TrainStep clears the
    # buckets before the first backward; on CPU in fp32 the same arithmetic)
    torchrun(2, tiny_overrides(small_corpus, tmp_path / "tp2", *base, "parallel.tp=2", "parallel.sp=true",
                               "train.grad_accum_fusion=true"))
    torchrun(4, tiny_overrides(small_corpus, tmp_path / "tp2dp2", *base, "parallel.tp=2"))
    # (dp2z1 also lets megaloom pick the micro-batch, train.micro_batch_size=0: the ranks agree on one; on CPU,
    # with no device limit, the whole per-rank batch of 4 - accumulation-free, still equal to the reference)
    torchrun(2, tiny_overrides(small_corpus, tmp_path / "dp2z1", *base, "parallel.zero=1", "train.micro_batch_size=0",
                               "train.grad_accum_fusion=true"))
    assert load_config(tmp_path / "dp2z1" / "config.yaml").train.micro_batch_size == 4
    # ZeRO-3 x tp: FSDP2 wraps the model on the meta device; each rank allocates its dim-0 share of its tp shard
    torchrun(4, tiny_overrides(small_corpus, tmp_path / "tp2z3", *base, "parallel.tp=2", "parallel.zero=3"))
    for run in ("tp2", "tp2dp2", "dp2z1", "tp2z3"):
        got = losses(tmp_path / run)
        assert sorted(got) == list(range(1, 11))
        for step, ref in reference.items():
            assert abs(got[step] - ref) <= 1e-5 * abs(ref), (run, step, got[step], ref)

    # The tp=2, ZeRO-1 and ZeRO-3 runs' checkpoints (step 5) resume in one process: steps 6..10 match.
    for run in ("tp2", "dp2z1", "tp2z3"):
        resumed = tmp_path / f"resumed-{run}"
        resumed.mkdir()
        ckpt = tmp_path / run / "checkpoints" / "step_00000005"
        cfg = load_config(None, tiny_overrides(small_corpus, resumed, *base, f"checkpoint.resume={ckpt}"))
        res = train(cfg)
        for step in range(6, 11):
            assert abs(res.losses[step] - reference[step]) <= 1e-5 * reference[step], (run, step)

    # Generation from the tp=2 run's final checkpoint, in a single process.
    from megaloom.generate import generate, load_for_generation

    model, tok = load_for_generation(tmp_path / "tp2", torch.device("cpu"))
    out = generate(model, torch.tensor([tok.encode("import ")]), 8, temperature=0.0)
    assert out.shape[1] > 1


def test_layout_errors_before_start(small_corpus, tmp_path):
    from megaloom.config import ConfigError

    with pytest.raises(ConfigError, match="parallel.tp"):
        train(load_config(None, tiny_overrides(small_corpus, tmp_path, "parallel.tp=2")))  # world size 1
    with pytest.raises(ConfigError, match=r"parallel.tp \* parallel.pp \* parallel.cp must be one of 1"):
        train(load_config(None, tiny_overrides(small_corpus, tmp_path, "parallel.cp=2")))
    with pytest.raises(ConfigError, match="parallel.zero=1 shards over data-parallel ranks"):
        train(load_config(None, tiny_overrides(small_corpus, tmp_path, "parallel.zero=1")))


def test_pipeline_layouts_match_single_process_and_resume_elsewhere(small_corpus, tmp_path):
    base = ["model.n_layers=4", "train.steps=6", "train.micro_batch_size=2", "train.grad_clip=0.5",
            "checkpoint.every=3", "train.eval_every=3"]
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "ref", *base)))
    torchrun(2, tiny_overrides(small_corpus, tmp_path / "pp2", *base, "parallel.pp=2", "parallel.schedule=zb"))
    torchrun(4, tiny_overrides(small_corpus, tmp_path / "pp2vpp2tp2", *base, "parallel.pp=2", "parallel.vpp=2",
                               "parallel.schedule=interleaved", "parallel.tp=2", "parallel.sp=true",
                               "train.grad_accum_fusion=true"))  # (weight gradients fused into the buckets)
    for run in ("pp2", "pp2vpp2tp2"):
        got = losses(tmp_path / run)
        for step, want in ref.losses.items():
            assert abs(got[step] - want) <= 1e-5 * want, (run, step, got[step], want)
    # the pp=2 checkpoint of step 3 continues in one process exactly like the uninterrupted run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    ckpt = tmp_path / "pp2" / "checkpoints" / "step_00000003"
    res = train(load_config(None, tiny_overrides(small_corpus, resumed, *base, f"checkpoint.resume={ckpt}")))
    for step in (4, 5, 6):
        assert abs(res.losses[step] - ref.losses[step]) <= 1e-5 * ref.losses[step], step


def test_moe_data_parallel_matches_single_process(small_corpus, tmp_path):
    base = ["model.preset=deepseek-v3-tiny", "model.d_model=64", "model.n_layers=2", "model.n_kv_heads=0",
            "train.steps=5",
            "train.micro_batch_size=2", "model.capacity_factor=1.0"]
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "ref", *base)))
    torchrun(2, tiny_overrides(small_corpus, tmp_path / "dp2", *base))
    got = losses(tmp_path / "dp2")
    for step, want in ref.losses.items():
        assert abs(got[step] - want) <= 1e-5 * want, (step, got[step], want)


def test_expert_parallel_layouts_match_single_process(small_corpus, tmp_path):
    """Mixtral-style MoE (aux + z losses, a shared expert; capacity 1.0, so tokens are dropped, or dropless) under
    ep 2 and 4, ep x tp (sp, also with async tp), ep with ZeRO-1/2/3 (edp 2; ZeRO-3 also at edp 1), ep with full
    recompute, ep with LAMB, and MoE
    under tp x pp: the single process's loss at every step (the same tokens dropped, the same aux-loss gradients),
    its gradient norm (expert gradients reduced over the right ranks) and its final weights. Checkpoints move
    between ep=2 and one process both ways. (ep x pp, dropless, at ZeRO 0/1/2: the pipeline world,
    tests/parallel/pipeline/test_zero_pp_world.py, in one started world instead of a torchrun per case.)
    In the same world, 1-bit Adam through the trainer at ep2 x dp4: AdamW's losses through its warm-up, then near
    them, and its step-3 checkpoint (in-place background save, error-feedback buffers) resumes bitwise."""
    base = ["model.preset=mixtral-tiny", "model.d_model=64", "model.n_layers=4", "model.ffn_dim=128",
            "model.expert_ffn_dim=64", "model.capacity_factor=1.0", "train.steps=5", "train.micro_batch_size=2",
            "train.grad_clip=0.5", "checkpoint.every=3"]
    ref = train(load_config(None, tiny_overrides(small_corpus, tmp_path / "ref", *base)))
    # LAMB's trust ratio needs each expert stack's norm summed over ep; without warmup a wrong ratio shows at once.
    lamb = ["train.optimizer=lamb", "train.warmup_steps=0", "train.lr=1e-2"]
    train(load_config(None, tiny_overrides(small_corpus, tmp_path / "ref-lamb", *base, *lamb)))
    dropless = ["model.capacity_factor=0"]  # every token reaches its experts
    train(load_config(None, tiny_overrides(small_corpus, tmp_path / "ref-dropless", *base, *dropless)))
    # One world of 4 processes runs every layout (dp fills the ranks that ep, tp and pp leave: ep2 is ep2 x edp2).
    runs = {"ep2": ["parallel.ep=2"], "ep4dropless": ["parallel.ep=4", *dropless],
            "ep2tp2sp": ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true"],
            "ep2tp2sp-async": ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true", "parallel.async_tp=true"],
            "ep2z1": ["parallel.ep=2", "parallel.zero=1"], "ep2z2": ["parallel.ep=2", "parallel.zero=2"],
            # ZeRO-3: experts sharded over edp (2, and 1 at ep4), dense weights over all of dp
            "ep2z3": ["parallel.ep=2", "parallel.zero=3"], "ep4z3dropless": ["parallel.ep=4", "parallel.zero=3",
                                                                            *dropless],
            "ep2recompute": ["parallel.ep=2", "train.recompute=full"],  # all-to-all again in backward
            "tp2pp2": ["parallel.tp=2", "parallel.pp=2"],
            "ep2lamb": ["parallel.ep=2", *lamb], "ep2z1lamb": ["parallel.ep=2", "parallel.zero=1", *lamb]}
    # 1-bit Adam through the trainer (ep2 over dp4: dense buckets compressed over 4 ranks, expert ones over edp 2),
    # then resumed from its step-3 checkpoint (written by the in-place background save) in a second run.
    onebit = ["parallel.ep=2", "train.optimizer=onebit_adam", "train.onebit_warmup_steps=2"]
    onebit_runs = {"ep2onebit": onebit, "ep2onebit-resumed": [
        *onebit, f"checkpoint.resume={tmp_path / 'ep2onebit' / 'checkpoints' / 'step_00000003'}"]}
    run_world(4, suite_expert_trainer_world4,
              {name: tiny_overrides(small_corpus, tmp_path / name, *base, *extra)
               for name, extra in {**runs, **onebit_runs}.items()}, timeout=600)
    onebit_losses, resumed_losses = losses(tmp_path / "ep2onebit"), losses(tmp_path / "ep2onebit-resumed")
    # AdamW through the warm-up; after it another algorithm, only near AdamW (its exactness is pinned against a
    # simulation in the dp worlds): the first compressed update, on a variance frozen after 2 steps, lands 2.4% lower
    for step, want in losses(tmp_path / "ref").items():
        assert abs(onebit_losses[step] - want) <= (1e-5 if step <= 3 else 0.05) * want, (step, onebit_losses, want)
    assert sorted(resumed_losses) == [4, 5]
    assert all(resumed_losses[s] == onebit_losses[s] for s in (4, 5)), (resumed_losses, onebit_losses)  # bitwise
    for name in runs:
        want_run = tmp_path / ("ref-lamb" if "lamb" in name else "ref-dropless" if "dropless" in name else "ref")
        got = losses(tmp_path / name)
        assert sorted(got) == list(range(1, 6)), name
        for step, want in losses(want_run).items():
            assert abs(got[step] - want) <= 1e-5 * want, (name, step, got[step], want)
        # AdamW hardly sees a wrongly scaled gradient (it normalises each weight's), the global norm does.
        norms = metric(tmp_path / name, "grad_norm")
        for step, want in metric(want_run, "grad_norm").items():
            assert abs(norms[step] - want) <= 1e-4 * want, (name, step, norms[step], want)
        # The final weights themselves (the layout-free checkpoint, loaded in one process) match too.
        got_w, want_w = final_weights(tmp_path / name), final_weights(want_run)
        for key, w in want_w.items():
            assert (got_w[key] - w).abs().max().item() <= 3e-6, (name, key)  # seen <= 7e-7
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    ckpt = tmp_path / "ep2" / "checkpoints" / "step_00000003"
    res = train(load_config(None, tiny_overrides(small_corpus, resumed, *base, f"checkpoint.resume={ckpt}")))
    for step in (4, 5):
        assert abs(res.losses[step] - ref.losses[step]) <= 1e-5 * ref.losses[step], step
    # ... and the single process's checkpoint resumes at ep=2 (each rank keeps its experts of the full tensors).
    ref_ckpt = tmp_path / "ref" / "checkpoints" / "step_00000003"
    torchrun(2, tiny_overrides(small_corpus, tmp_path / "to-ep2", *base, "parallel.ep=2",
                               f"checkpoint.resume={ref_ckpt}"))
    got = losses(tmp_path / "to-ep2")
    for step in (4, 5):
        assert abs(got[step] - ref.losses[step]) <= 1e-5 * ref.losses[step], step
