"""A LoRA fine-tune under the HF Trainer with lensadapters' ProbeCallback, and a plot of one head's trajectory.

Runs on the CPU in a few seconds with a tiny seeded Llama (no download): ``python docs/probe_trajectory.py OUT_DIR``
writes the probes to ``OUT_DIR/probes`` and the plot to ``OUT_DIR/probe_trajectory.png`` (needs matplotlib).
Under ``torchrun --nproc_per_node N`` the same script trains with DDP; rank 0 writes the probes.
"""

import os
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments

from lensadapters.testing.tiny_models import tiny
from lensadapters.training import ProbeCallback, load_probes

out = sys.argv[1] if len(sys.argv) > 1 else "probe-run"
model = tiny("llama")
peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"]))
vocab = model.config.vocab_size
rows = torch.randint(0, vocab, (256, 16), generator=torch.Generator().manual_seed(0))
rows[:, 8:] = rows[:, :8]  # a repeated half: something for the attention to learn
train = [{"input_ids": row, "labels": row} for row in rows]
probe = rows[:4]  # a fixed probe batch
point, head = "blocks.1.attn.hook_z", 0

trainer = Trainer(
    model=peft_model,
    args=TrainingArguments(
        output_dir=os.path.join(out, "trainer"),
        use_cpu=True,
        max_steps=60,
        learning_rate=2e-2,
        per_device_train_batch_size=8,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
    ),
    train_dataset=train,
    callbacks=[ProbeCallback(probe, [point], os.path.join(out, "probes"), every=5)],
)
trainer.train()

if trainer.is_world_process_zero():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = load_probes(os.path.join(out, "probes"))  # values [steps, batch, pos, head, d_head]
    adapted, base = record[point][:, :, :, head], record["base/" + point][:, :, :, head]
    change = (adapted - base).norm(dim=-1).mean(dim=(1, 2)) / base.norm(dim=-1).mean(dim=(1, 2))
    plt.figure(figsize=(5, 3))
    plt.plot(record.steps, change.numpy(), marker="o")
    plt.xlabel("training step")
    plt.ylabel("|z_adapted - z_base| / |z_base|")
    plt.title(f"{point}, head {head}: LoRA's change on the probe batch", fontsize=9)
    plt.tight_layout()
    plt.savefig(os.path.join(out, "probe_trajectory.png"), dpi=100)
    print("steps", record.steps, "relative change", [round(float(c), 4) for c in change])
