#!/usr/bin/env python3
"""dump.py (../shared/peers/maxtext/dump.py) made to work with MaxText 0.2.0 (Linen train state):
* `maxtext` is a namespace package there (no __file__): base.yml is found through maxtext.configs;
* 0.2.0 has no remove_size_one_mesh_axis_from_type key: it is set to True in explicit mode, as 0.2.0's
  train_compile.get_topology_mesh does;
* 0.2.0's get_shaped_inputs returns the Linen state; its logical_annotations are the logical axis names,
  so logical_names.json is written from them (there are no NNX variables);
* sharding.clear_input_shardings_dump is used only if the release has it.

MaxText's sharding dump (named_shardings.json, logical_shardings.json, input_shardings.json) on CPU.

Usage (through dump.sh):
  dump.sh [config.yml] [num_devices=N] output_dir=DIR key=value ...

MaxText's golden generator (tests/utils/sharding_dump.py in the MaxText repository, not shipped in
the pip wheel) builds a mesh over a TPU `compile_topology` (which needs libtpu) and calls
`maxtext.trainers.pre_train.train_compile.get_shaped_inputs(mesh, config)` with debug_sharding=true.
This script does the same with N forced host CPU devices instead of a TPU topology: the mesh is
`maxtext_utils.create_device_mesh(config, jax.devices())` with the axis types of shard_mode, exactly
as train_compile.get_topology_mesh builds it for a topology. Nothing is compiled or allocated
(get_shaped_inputs is abstract: eval_shape), so full-size models (deepseek2-16b, 671b) dump in
seconds.

The JSON layout follows MaxText's dump files:
  named_shardings.json   {path: {mesh: {axis_names, shape}, partition_spec, shape}}
  logical_shardings.json {path: {partition_spec, shape}}
  input_shardings.json   {"Activation Sharding Dump": [{"<file>/<var>: <dtype>[shape]":
                                                        {logic_axes, PartitionSpec}}, ...]}
Paths are jax.tree_util key paths joined with "/" as MaxText does. MaxText 0.2.5 is NNX-only, so
paths name the NNX train state (e.g. ".model/decoder/..."), while the Linen-era goldens name
".params/['params']/['decoder']/..."; see compare_goldens.py for a name-normalising comparison.
In 0.2.5, logical_shardings.json from get_shaped_inputs holds the *physical* PartitionSpecs
(maxtext_utils_nnx.get_partition_spec_nnx); this script writes that file as MaxText does and, in
addition, logical_names.json with the NNX variables' logical axis names (the Linen goldens'
logical_shardings content).

Defaults added unless given (as MaxText's run_sharding_dump does): weight_dtype=float32
log_config=false debug_sharding=true, plus hardware=cpu skip_jax_distributed_system=true.
"""
import json
import os
import sys
import time


def parse_argv(argv):
  yml, keys, num_devices, outdir = None, [], None, None
  for a in argv:
    if "=" not in a and a.endswith((".yml", ".yaml")):
      yml = a
    elif a.startswith("num_devices="):
      num_devices = int(a.split("=", 1)[1])
    elif a.startswith("output_dir="):
      outdir = a.split("=", 1)[1]
    elif "=" in a:
      keys.append(a)
    else:
      sys.exit(f"dump.py: unexpected argument {a!r}")
  return yml, keys, num_devices, outdir


def json_spec(spec):
  def conv(e):
    if isinstance(e, tuple):
      return [conv(x) for x in e]
    return None if e is None else str(e)

  return [conv(e) for e in spec]


def key_name(path):
  return "/".join(str(p) for p in path)


def main():
  yml, keys, num_devices, outdir = parse_argv(sys.argv[1:])
  if not outdir:
    sys.exit("dump.py: output_dir=DIR is required")
  if num_devices is None:
    prod, minus = 1, False
    for kv in keys:
      k, v = kv.split("=", 1)
      if k.startswith("ici_") and k.endswith("_parallelism"):
        v = int(v)
        minus |= v == -1
        prod *= v if v > 0 else 1
    num_devices = 8 if minus else prod
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={num_devices}"])
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, AxisType, NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  from jax.tree_util import tree_flatten_with_path  # pylint: disable=import-outside-toplevel
  import maxtext  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.common.common_types import ShardMode  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils, sharding  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train_compile  # pylint: disable=import-outside-toplevel

  import maxtext.configs  # pylint: disable=import-outside-toplevel
  yml = yml or os.path.join(list(maxtext.configs.__path__)[0], "base.yml")
  given = {kv.split("=", 1)[0] for kv in keys}
  defaults = {
      "weight_dtype": "float32",
      "log_config": "false",
      "debug_sharding": "true",
      "hardware": "cpu",
      "skip_jax_distributed_system": "true",
      "enable_checkpointing": "false",
      "jax_cache_dir": "",
      "run_name": "dump",
      "base_output_directory": os.path.join(os.path.abspath(outdir), "maxtext_out"),
  }
  keys = keys + [f"{k}={v}" for k, v in defaults.items() if k not in given]
  t0 = time.perf_counter()
  config = pyconfig.initialize(["dump", yml] + keys)

  if "remove_size_one_mesh_axis_from_type" in getattr(config, "get_keys", lambda: {})():
    jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
  elif config.shard_mode == ShardMode.EXPLICIT:
    jax.config.update("jax_remove_size_one_mesh_axis_from_type", True)
  devices = jax.devices()
  device_mesh = maxtext_utils.create_device_mesh(config, devices)
  axis_type = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
  mesh = Mesh(device_mesh, config.mesh_axes, axis_types=(axis_type,) * len(config.mesh_axes))
  print(f"dump: {len(devices)} devices, mesh {dict(mesh.shape)}", flush=True)

  if hasattr(sharding, "clear_input_shardings_dump"):
    sharding.clear_input_shardings_dump()
  shaped_args, _, state_mesh_shardings, logical_annotations, _ = train_compile.get_shaped_inputs(mesh, config)
  state_shapes = shaped_args[0]

  named, logical, names = {}, {}, {}
  flat_sh = tree_flatten_with_path(state_mesh_shardings)[0]
  flat_shape = tree_flatten_with_path(state_shapes)[0]
  for (p, s), (_, a) in zip(flat_sh, flat_shape):
    if isinstance(s, NamedSharding):
      named[key_name(p)] = {
          "mesh": {"axis_names": list(s.mesh.axis_names), "shape": dict(s.mesh.shape)},
          "partition_spec": json_spec(s.spec),
          "shape": list(a.shape) if hasattr(a, "shape") else None,
      }
  flat_l = tree_flatten_with_path(logical_annotations, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None)[0]
  for (p, s), (_, a) in zip(flat_l, flat_shape):
    if isinstance(s, PartitionSpec) or s is None:
      logical[key_name(p)] = {
          "partition_spec": json_spec(s) if s is not None else None,
          "shape": list(a.shape) if hasattr(a, "shape") else None,
      }

  # Logical axis names from the NNX variables' metadata ("sharding" / "out_sharding" / "sharding_names").
  from flax import nnx  # pylint: disable=import-outside-toplevel

  def var_names(v):
    for attr in ("sharding_names", "out_sharding", "sharding"):
      try:
        val = v.get_metadata().get(attr) if hasattr(v, "get_metadata") else getattr(v, attr, None)
      except Exception:  # pylint: disable=broad-except
        val = getattr(v, attr, None)
      if val is not None and not isinstance(val, NamedSharding):
        return [None if x is None else (list(x) if isinstance(x, (tuple, list)) else str(x)) for x in tuple(val)]
    return None

  if not any(str(k).startswith("['model']") for k in named):  # Linen state: the annotations are the names
    for k, v in logical.items():
      names[k] = v
  try:
    flat_vars = tree_flatten_with_path(state_shapes, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for p, v in flat_vars:
      if isinstance(v, nnx.Variable):
        k = key_name(p)
        k = k + "/.value" if k + "/.value" in named else k
        names[k] = {"partition_spec": var_names(v), "shape": list(v.shape) if hasattr(v, "shape") else None}
  except Exception as e:  # pylint: disable=broad-except
    print(f"dump: logical names unavailable: {e}", flush=True)

  os.makedirs(outdir, exist_ok=True)
  files = {
      "named_shardings.json": named,
      "logical_shardings.json": logical,
      "input_shardings.json": {"Activation Sharding Dump": list(sharding._ACTIVATION_SHARDINGS_DUMP)},  # pylint: disable=protected-access
  }
  if names:
    files["logical_names.json"] = names
  for fn, obj in files.items():
    with open(os.path.join(outdir, fn), "w", encoding="utf-8") as f:
      json.dump(obj, f, indent=2)
  print(
      f"dump: wrote {len(named)} named, {len(logical)} logical, {len(names)} logical-name, "
      f"{len(files['input_shardings.json']['Activation Sharding Dump'])} activation entries to {outdir} "
      f"in {time.perf_counter() - t0:.1f}s",
      flush=True,
  )


if __name__ == "__main__":
  main()
