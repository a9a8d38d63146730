#!/usr/bin/env python3
"""MaxText 0.2.0's training losses from given parameters and shardsim's tokens, on CPU.

../../maxtext-0.2.5/losses/peer_loss.py made to work with 0.2.0's train.py: a Linen train state
(state.params["params"], replaced after train_utils.setup_train_loop) and no training_loop_iteration (the
loss is read from each call of the jitted step that train_utils.jit_train_and_eval_step returns).

Usage (with the MaxText venv's python; gen.sh beside this file runs it):
  peer_loss.py PARAMS.safetensors OUT.json num_devices=N key=value ...

* PARAMS.safetensors: a parameter file as shardsim writes it (checkpoint_dir): float32 tensors named by
  MaxText's parameter paths in dotted form ("params.decoder.layers.self_attention.query.kernel"), in
  MaxText's scanned layout.  Every parameter of MaxText's train state must be in the file and vice versa.
* The tokens of step s are shardsim's dataset_type=synthetic batch of step s (models/core/data.h:
  row r is T+1 tokens of x[t+1] = (a x[t] + c) mod Vs from a splitmix64-derived start), recomputed here
  and fed to MaxText in place of its own synthetic batch (inputs, targets, positions 0..T-1,
  segmentation all ones).
* key=value are MaxText config overrides (the peer's train.py defaults are added: hardware=cpu
  dtype=float32 ...).  MaxText builds its train state and jitted train step as in training; before
  step 0 the parameters are replaced by the file's (each keeping MaxText's sharding; the optimizer
  state is MaxText's fresh one), and each step's batch by shardsim's.  OUT.json gets the per-step
  `learning/loss` values (MaxText's metric) and the command.
Python is used only to generate test data; the tests read OUT.json's figures.
"""
import json
import os
import struct
import sys
import tempfile

import numpy as np

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix64(z):
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
  return z ^ (z >> 31)


def synthetic_batch(seed, step, rows, seq, vocab):
  """shardsim's model_batch_global for dataset_type=synthetic (models/core/data.c)."""
  vs = min(vocab, 256)
  a = 5
  while np.gcd(a, vs) != 1:
    a += 1
  c = 3 % vs
  out = np.zeros((rows, seq + 1), dtype=np.int32)
  for r in range(rows):
    h = mix64((mix64((mix64((seed + GOLDEN) & MASK) + step * GOLDEN) & MASK) + (r + 1) * GOLDEN) & MASK)
    x = h % vs
    for t in range(seq + 1):
      out[r, t] = x
      x = (a * x + c) % vs
  return out[:, :seq], out[:, 1:]


def read_safetensors(path):
  with open(path, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    data = f.read()
  out = {}
  for name, meta in header.items():
    if name == "__metadata__" or not name.startswith("params."):
      continue
    assert meta["dtype"] == "F32", (name, meta["dtype"])
    b, e = meta["data_offsets"]
    out[name] = np.frombuffer(data[b:e], dtype=np.float32).reshape(meta["shape"])
  return out


def main():
  if len(sys.argv) < 3:
    sys.exit(__doc__)
  params_path, out_path = sys.argv[1], sys.argv[2]
  keys, num_devices = [], None
  for a in sys.argv[3:]:
    if a.startswith("num_devices="):
      num_devices = int(a.split("=", 1)[1])
    else:
      keys.append(a)
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={num_devices}"])
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax  # pylint: disable=import-outside-toplevel
  import maxtext  # pylint: disable=import-outside-toplevel
  import maxtext.trainers.pre_train.train as T  # pylint: disable=import-outside-toplevel
  from absl import app  # pylint: disable=import-outside-toplevel

  user_keys = list(keys)
  given = {k.split("=", 1)[0] for k in keys}
  defaults = {"hardware": "cpu", "skip_jax_distributed_system": "true", "dataset_type": "synthetic",
              "enable_checkpointing": "false", "dtype": "float32", "run_name": "cpu",
              "base_output_directory": tempfile.mkdtemp(prefix="maxtext-loss-"), "enable_tensorboard": "false",
              "megablox": "false", "jax_cache_dir": "", "sharding_tolerance": "0.3"}
  keys += [f"{k}={v}" for k, v in defaults.items() if k not in given]
  params = read_safetensors(params_path)
  losses, replaced = [], []
  # 0.2.0's train.train_loop (Linen state, no training_loop_iteration): the state comes from
  # train_utils.setup_train_loop, the step from jit_train_and_eval_step; both are wrapped.
  orig_setup = T.train_utils.setup_train_loop

  def setup_train_loop(config, *a, **k):
    out = list(orig_setup(config, *a, **k))
    state, loader = out[-1], out[7]
    tree = state.params["params"]
    seen = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      name = "params." + ".".join(str(getattr(p, "key", p)) for p in path)
      if name not in params:
        sys.exit(f"peer_loss: MaxText's parameter {name} {leaf.shape} is not in {params_path}")
      if tuple(params[name].shape) != tuple(leaf.shape):
        sys.exit(f"peer_loss: {name}: file shape {params[name].shape}, MaxText {leaf.shape}")
      seen.add(name)
    missing = set(params) - seen
    if missing:
      sys.exit(f"peer_loss: the file has parameters MaxText does not: {sorted(missing)}")

    def put(path, leaf):
      name = "params." + ".".join(str(getattr(p, "key", p)) for p in path)
      return jax.device_put(params[name].astype(leaf.dtype), leaf.sharding)

    new_tree = jax.tree_util.tree_map_with_path(put, tree)
    state = state.replace(params={**state.params, "params": new_tree})
    replaced.append(len(seen))
    orig_load = loader.load_next_batch
    calls = [0]

    def load_next_batch(*a2, **k2):
      batch = orig_load(*a2, **k2)
      step = calls[0]
      calls[0] += 1
      rows, seq = batch["inputs"].shape
      inputs, targets = synthetic_batch(int(config.data_shuffle_seed), step, rows, seq, int(config.vocab_size))
      pos = np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq))
      ones = np.ones((rows, seq), dtype=np.int32)
      mine = {"inputs": inputs, "targets": targets, "inputs_position": pos, "targets_position": pos,
              "inputs_segmentation": ones, "targets_segmentation": ones}
      return {kk: jax.device_put(mine[kk].astype(v.dtype), v.sharding) if kk in mine else v for kk, v in batch.items()}

    loader.load_next_batch = load_next_batch
    out[-1] = state
    return tuple(out)

  orig_jit = T.train_utils.jit_train_and_eval_step

  class Step:  # p_train_step, recording learning/loss per call (.lower etc. pass through)
    def __init__(self, f):
      self.f = f

    def __call__(self, *a, **k):
      state, metrics = self.f(*a, **k)
      loss = float(jax.device_get(metrics["scalar"]["learning/loss"]))
      print(f"[peer-loss] step {len(losses)} loss {loss:.9f}", flush=True)
      losses.append({"step": len(losses), "loss": loss})
      return state, metrics

    def __getattr__(self, n):
      return getattr(self.f, n)

  def jit_train_and_eval_step(*a, **k):
    p_train, p_eval = orig_jit(*a, **k)
    return Step(p_train), p_eval

  T.train_utils.setup_train_loop = setup_train_loop
  T.train_utils.jit_train_and_eval_step = jit_train_and_eval_step
  import maxtext.configs  # pylint: disable=import-outside-toplevel
  base = os.path.join(list(maxtext.configs.__path__)[0], "base.yml")
  rc = 0
  try:
    app.run(T.main, argv=["train", base] + keys)
  except SystemExit as e:
    rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  if rc or not losses:
    sys.exit(f"peer_loss: MaxText exited {rc} after {len(losses)} steps")
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump({"maxtext": "0.2.0", "jax": jax.__version__, "num_devices": num_devices, "params": os.path.basename(params_path),
               "parameters_replaced": replaced[0], "overrides": user_keys, "defaults_added": [k for k in keys if k not in user_keys],
               "losses": losses}, f, indent=1)


if __name__ == "__main__":
  main()
