"""One rank of a 2-process gloo job for tests/test_distributed.py: ``torchrun ... distributed_worker.py SCENARIO OUT``.

Every rank builds the same seeded tiny model and an unwrapped, undistributed copy of it (the reference), runs its own
half of a batch through the distributed model and checks the result against the reference on the same half; failed
checks raise (the job fails). Each rank writes ``OUT/SCENARIO-rankR.json`` with what it checked.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from lensadapters import HookedModel
from lensadapters.distributed import is_dtensor
from lensadapters.testing.tiny_models import tiny

ARCH = "llama"
POINTS = ["blocks.0.ln1.hook_scale", "blocks.0.attn.hook_result", "blocks.0.hook_resid_post", "blocks.1.mlp.hook_post"]
WEIGHTS = ["W_E", "W_U", "W_Q", "W_K", "W_O", "W_in", "W_out"]


def batch(rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (4 rows of 7 tokens) and this rank's half of it."""
    tokens = torch.randint(0, vocab, (4, 7), generator=torch.Generator().manual_seed(1))
    return tokens, tokens[2 * rank : 2 * rank + 2]


def halve(value: torch.Tensor, hook) -> torch.Tensor:
    return value * 0.5


def hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]


def hook_order(model: nn.Module) -> list[tuple[list[int], list[int]]]:
    return [(list(m._forward_pre_hooks), list(m._forward_hooks)) for m in model.modules()]


def reference_grads(ref: HookedModel, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradients data parallelism must give: the mean over the two halves of each half's loss gradient, with
    the edit of ``halve`` at ``blocks.0.hook_resid_mid``."""
    total: dict[str, torch.Tensor] = {}
    for half in (tokens[:2], tokens[2:]):
        ref.hf_model.zero_grad()
        with ref.hooks([("blocks.0.hook_resid_mid", halve)]):
            ref(input_ids=half, labels=half).loss.backward()
        for name, p in ref.hf_model.named_parameters():
            total[name] = total.get(name, 0) + p.grad / 2
    ref.hf_model.zero_grad()
    return total


def check_cache_edit_and_weights(hm: HookedModel, ref: HookedModel, local: torch.Tensor, exact: bool) -> dict:
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    with torch.no_grad():
        _, cache = hm.run_with_cache(local, names_filter=POINTS)
        _, expected = ref.run_with_cache(local, names_filter=POINTS)
        assert sorted(cache.keys()) == sorted(POINTS)
        for name in POINTS:
            assert same(cache[name], expected[name]), name
        edited = hm.run_with_hooks(input_ids=local, fwd_hooks=[("blocks.0.hook_resid_mid", halve)])
        expected_edit = ref.run_with_hooks(input_ids=local, fwd_hooks=[("blocks.0.hook_resid_mid", halve)])
        plain = ref(input_ids=local).logits
        assert same(edited, expected_edit) and not torch.allclose(edited, plain)
    for name in WEIGHTS:
        value = getattr(hm, name)
        assert not is_dtensor(value), name  # the whole matrix, not a shard
        assert torch.equal(value, getattr(ref, name)), name
    return {"points": POINTS, "weights": WEIGHTS}


def check_gradients(hm: HookedModel, ref: HookedModel, tokens: torch.Tensor, local: torch.Tensor, grad_of) -> dict:
    """A training step through the distributed wrapper with an edit and a backward hook: parameter gradients are
    the mean over both halves, the hook sees this rank's gradient."""
    seen: dict[str, torch.Tensor] = {}

    def keep_grad(grad: torch.Tensor, hook) -> None:
        seen["grad"] = grad.detach().clone()

    hm.hf_model.zero_grad()
    with hm.hooks([("blocks.0.hook_resid_mid", halve)], [("blocks.1.hook_resid_pre", keep_grad)]):
        hm(input_ids=local, labels=local).loss.backward()
    expected = reference_grads(ref, tokens)
    for name, p in hm.hf_model.named_parameters():
        assert torch.allclose(grad_of(p), expected[name], rtol=1e-4, atol=1e-6), name
    distributed_grad = seen.pop("grad")
    with ref.hooks([("blocks.0.hook_resid_mid", halve)], [("blocks.1.hook_resid_pre", keep_grad)]):
        ref(input_ids=local, labels=local).loss.backward()
    assert torch.allclose(distributed_grad, seen["grad"], rtol=1e-4, atol=1e-7)
    ref.hf_model.zero_grad()
    hm.hf_model.zero_grad()
    return {"gradients": len(expected)}


def ddp_scenario(rank: int) -> dict:
    model = tiny(ARCH)
    ref = HookedModel.wrap(copy.deepcopy(model))
    tokens, local = batch(rank, model.config.vocab_size)
    before = hook_counts(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    hm = HookedModel.wrap(ddp)
    assert hm.model is ddp and hm.hf_model is model
    report = check_cache_edit_and_weights(hm, ref, local, exact=True)
    model.train(), ref.hf_model.train()  # the tiny configs have no dropout: train mode computes the same
    report.update(check_gradients(hm, ref, tokens, local, grad_of=lambda p: p.grad))
    assert hm.unwrap() is ddp and ddp.module is model and hook_counts(model) == before
    with torch.no_grad():
        assert torch.equal(ddp(input_ids=local).logits, ref.hf_model(input_ids=local).logits)

    # wrapped first, then put under DDP: the user's training loop calls the DDP module, hook points still fire
    inner = tiny(ARCH)
    hm2 = HookedModel.wrap(inner)
    ddp2 = nn.parallel.DistributedDataParallel(inner)
    fired = []
    with hm2.hooks([("blocks.0.hook_resid_mid", lambda v, hook: fired.append(hook.name) or v * 0.5)]):
        edited = ddp2(input_ids=local).logits
    with ref.hooks([("blocks.0.hook_resid_mid", halve)]), torch.no_grad():
        assert fired == ["blocks.0.hook_resid_mid"] and torch.allclose(edited, ref.hf_model(input_ids=local).logits)
    hm2.unwrap()
    report["wrapped_before_ddp"] = True
    return report


def fsdp2_scenario(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def shard(model: nn.Module) -> nn.Module:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    report = {}
    for order in ("sharded-then-wrapped", "wrapped-then-sharded"):
        model = tiny(ARCH)
        ref = HookedModel.wrap(copy.deepcopy(model))
        tokens, local = batch(rank, model.config.vocab_size)
        cls = type(model)
        if order == "sharded-then-wrapped":
            before = hook_order(shard(model))
            hm = HookedModel.wrap(model)
        else:
            hm = HookedModel.wrap(model)
            shard(model)
        assert isinstance(model, cls) and isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor)
        report[order] = check_cache_edit_and_weights(hm, ref, local, exact=False)
        model.train(), ref.hf_model.train()
        report[order].update(check_gradients(hm, ref, tokens, local, grad_of=lambda p: p.grad.full_tensor()))
        sharded_class = type(model)
        assert hm.unwrap() is model and type(model) is sharded_class
        if order == "sharded-then-wrapped":
            assert hook_order(model) == before  # FSDP2's hooks where they were, ours gone
        assert all(isinstance(p, DTensor) for p in model.parameters())  # as FSDP2 left them
    return report


def trainer_scenario(rank: int, out: str) -> dict:
    """A LoRA fine-tune under the HF Trainer (DDP over gloo) with the probe callback recording every 2 steps."""
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from lensadapters.training import ProbeCallback, load_probes

    model = tiny(ARCH)
    model.train()
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    vocab = model.config.vocab_size
    rows = torch.randint(0, vocab, (16, 9), generator=torch.Generator().manual_seed(2))
    data = [{"input_ids": row, "labels": row} for row in rows]
    probe = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(3))
    points = ["blocks.0.attn.hook_z", "blocks.1.hook_resid_post"]
    probes = os.path.join(out, "probes")
    args = TrainingArguments(
        output_dir=os.path.join(out, "trainer"),
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=5e-2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=peft_model, args=args, train_dataset=data, callbacks=[ProbeCallback(probe, points, probes, every=2)]
    )
    assert trainer.args.world_size == 2
    trainer.train()
    assert isinstance(trainer.model_wrapped, nn.parallel.DistributedDataParallel)  # the Trainer ran DDP
    dist.barrier()  # rank 0 has written the last step
    record = load_probes(probes)
    assert record.steps == [0, 2, 4], record.steps
    peft_model.eval()
    hm = HookedModel.wrap(peft_model)
    with torch.no_grad():
        _, now = hm.run_with_cache(probe, names_filter=points)
    hm.unwrap()
    for name in points:
        base, adapted = record["base/" + name], record[name]
        assert all(torch.equal(base[0], b) for b in base)  # the frozen base model never changes
        assert torch.equal(adapted[0], base[0])  # LoRA starts as a zero delta
        assert not torch.allclose(adapted[-1], adapted[0])  # and moves
        assert torch.allclose(adapted[-1], now[name], atol=1e-6)  # the last record is the trained model's
    assert torch.equal(record["inputs/input_ids"][0], probe)
    from safetensors import safe_open

    writers = set()
    for step in record.steps:
        with safe_open(os.path.join(probes, f"step-{step:09d}.safetensors"), "pt") as handle:
            writers.add(handle.metadata()["rank"])
    assert writers == {"0"}
    assert all(p.requires_grad for n, p in peft_model.named_parameters() if "lora_" in n)  # as before the probes
    return {"steps": record.steps, "points": points}


SCENARIOS = {"ddp": ddp_scenario, "fsdp2": fsdp2_scenario, "trainer": trainer_scenario}


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    report = SCENARIOS[scenario](rank, out) if scenario == "trainer" else SCENARIOS[scenario](rank)
    dist.barrier()
    with open(os.path.join(out, f"{scenario}-rank{rank}.json"), "w") as handle:
        json.dump({"rank": rank, "world_size": dist.get_world_size(), **report}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
