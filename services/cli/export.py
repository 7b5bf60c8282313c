"""`kuberl export CHECKPOINT --format onnx|torchscript`: the trained policy as one file that a C++, C#
or JavaScript program loads (ONNX Runtime, or libtorch's torch::jit::load), without Python or kuberl.

What is exported is the algorithm's deterministic policy (`Acting.greedy`: argmax of the logits or of
Q, the Gaussian's mean, SAC's squashed mean, Box actions clipped into the space's bounds) with the
checkpoint's weights, loaded as an actor loads them (services/cli/trained.py). Its input `obs` is a
batch of observations as the actors' envs produce them ([batch, *observation shape], of the
observation dtype: float32 vectors, uint8 Atari frames, int64 indices of a Discrete observation
([batch]) or a MultiDiscrete one ([batch, k]), which the graph one-hot encodes itself; a Dict's
Discrete keys are their indices among its float32 values, the `categories` of the metadata's
`kuberl.observation`). A policy trained under action masks (PPO on
a Discrete or MultiDiscrete space whose env reports `info["action_mask"]`) has a second input,
`action_mask`: bool [batch, mask width], True where an action is allowed, in the layout of the env's
`info["action_mask"]`; the graph never chooses a disallowed action. `--action-mask auto` (the default)
adds it when the run's env reports masks on reset; `yes` and `no` decide it (an external simulator's
env, or one whose module is not importable here, cannot be asked, so auto leaves it out and says so;
nothing else needs the env: the policy's spaces come from the checkpoint). Its one output, `action`, is a batch of env
actions (int64 indices for Discrete, int64 [batch, choices] for MultiDiscrete, float32 [batch, *shape]
for Box). Everything the network does to an observation is inside the graph: the Atari torso's /255,
and PPO's running observation normalisation (`ppo.normalize_observations`), whose mean and variance
become constants of the graph. A recurrent policy (`ppo.recurrent`) has the state as an explicit
input, `state` float32 [batch, state_size] after `obs` (zeros at an episode's start), and a second
output, `next_state`, to hand back in with the next observation.

ONNX uses torch's torch.export-based exporter (the default since torch 2.9; it needs the onnx and
onnxscript packages), with a dynamic batch dimension. TorchScript is written by tracing
(torch.jit.trace); torch marks TorchScript as deprecated, so prefer ONNX for new consumers. Both
exporters warn about their own internals; those warnings are silenced here, not the errors.

After writing, the file is loaded back (onnxruntime, or torch.jit.load) and its actions on random
observations (and random masks) are compared with the torch policy's: a mismatch is an error (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import warnings
from pathlib import Path

import numpy as np

FORMATS = {"onnx": ".onnx", "torchscript": ".pt"}
CHECK_BATCH = 64  # random observations the written file is checked on
MASK_CHOICES = ("auto", "yes", "no")  # --action-mask
OPSET = 18
STATE_STEPS = 16  # steps a recurrent policy's export is checked through, its state fed back


class ExportError(ValueError):
    """An export that cannot be made as asked; the message says what is wrong."""


@contextlib.contextmanager
def _quiet_exporter():
    """torch's exporters warn about their own deprecated internals (FutureWarning, DeprecationWarning)
    and log what they skip (torchvision's operators); neither concerns the policy being exported."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def sample_observations(spec, n: int, seed: int = 0) -> np.ndarray:
    """`n` random observations of the policy's input layout: uint8 frames uniform over 0..255,
    categorical elements (a Discrete observation, a Dict's Discrete keys) uniform over 0..n-1, other
    observations standard normal (scaled by 3, to reach the normaliser's clip and a Box's bounds)."""
    rng = np.random.default_rng(seed)
    shape = (n, *spec.obs_shape)
    if spec.obs_dtype == np.uint8:
        return rng.integers(0, 256, shape, dtype=np.uint8)
    obs = (3.0 * rng.standard_normal(shape)).astype(spec.obs_dtype)
    flat = obs.reshape(n, -1)   # (a view: writes into `obs`)
    for i, values in spec.obs_categories:
        flat[:, i] = rng.integers(0, values, n)
    return obs


def sample_masks(space, n: int, seed: int = 0) -> np.ndarray:
    """`n` random action masks for `space` (bool [n, mask width]), each allowing at least one value of
    every choice, about half of the values allowed."""
    rng = np.random.default_rng(seed)
    mask = rng.random((n, space.mask_width)) < 0.5
    start = 0
    for width in getattr(space, "nvec", None) or (space.n,):
        part = mask[:, start:start + width]
        part[np.arange(n), rng.integers(0, width, n)] = True   # (a view: writes into `mask`)
        start += width
    return mask


def example_inputs(trained, n: int, masked: bool, seed: int = 0) -> tuple[np.ndarray, ...]:
    """The graph's inputs for `n` random observations: obs, then a recurrent policy's state (random,
    float32 [n, state_size]), then action_mask when `masked`."""
    obs = sample_observations(trained.spec, n, seed)
    size = trained.policy.state_size
    state = (np.random.default_rng(seed).normal(size=(n, size)).astype(np.float32),) if size else ()
    return (obs, *state, *((sample_masks(trained.spec.action, n, seed),) if masked else ()))


def input_names(trained, masked: bool) -> list[str]:
    return ["obs", *(["state"] if trained.policy.state_size else []), *(["action_mask"] if masked else [])]


def output_names(trained) -> list[str]:
    """`action`, and for a recurrent policy `next_state`: the state to hand in with the next observation."""
    return ["action", "next_state"] if trained.policy.state_size else ["action"]


def env_reports_masks(trained) -> bool | None:
    """Whether the run's env reports `info["action_mask"]` on reset; None when it cannot be made here
    (external simulators, or an env this machine lacks)."""
    from services.common.envs import make_vector_env

    if trained.cfg.env.mode == "external":
        return None
    cfg = trained.cfg
    try:   # (a policy of several: its own agents' group)
        envs = make_vector_env(cfg.env, num_envs=1, policies={k: v.agents for k, v in cfg.policies.items()} or None)
    except Exception:  # noqa: BLE001 - gymnasium raises its own errors for an env it cannot make
        return None
    try:
        masks = envs.reset(seed=0)[1].get("action_mask")
        return masks is not None and (not isinstance(masks, dict) or trained.name in masks)   # (by group)
    except Exception:  # noqa: BLE001 - an env that cannot reset here: unknown, as one that cannot be made
        return None
    finally:
        envs.close()


def mask_input(trained, choice: str) -> tuple[bool, str | None]:
    """Whether the graph gets an `action_mask` input for `--action-mask choice` (auto, yes or no), and
    a note for the user when auto could not tell; ExportError for `yes` on a policy that takes no mask."""
    if choice not in MASK_CHOICES:
        raise ExportError(f"--action-mask {choice!r}: use auto, yes or no")
    if choice == "no" or (choice == "auto" and not trained.takes_masks):
        return False, None
    if not trained.takes_masks:
        raise ExportError(f"--action-mask yes: {trained.cfg.algorithm} on {trained.spec.action} takes no action masks")
    if choice == "yes":
        return True, None
    reports = env_reports_masks(trained)
    if reports is None:
        return False, (f"env {trained.cfg.env.id!r} cannot be made here, so whether it reports action masks "
                       "is unknown: the graph has no action_mask input (--action-mask yes adds one)")
    return reports, None


def metadata(trained, masked: bool) -> dict[str, str]:
    """What a consumer needs besides the graph: where it came from and the spaces' layout."""
    spec = trained.spec
    return {"kuberl.algorithm": trained.cfg.algorithm, "kuberl.env_id": trained.cfg.env.id,
            "kuberl.policy_version": str(trained.version),
            "kuberl.observation": json.dumps({"shape": list(spec.obs_shape), "dtype": spec.obs_dtype.name,
                                              **_categorical(spec)}),
            "kuberl.action_space": str(spec.action),
            "kuberl.inputs": json.dumps(input_names(trained, masked)),
            "kuberl.outputs": json.dumps(output_names(trained)),
            "kuberl.state_size": str(trained.policy.state_size)}


def _categorical(spec) -> dict[str, object]:
    """The metadata of a categorical observation: its space (Discrete(n), MultiDiscrete([..]), or
    Dict(key: space, ...)) and `categories`, [flat index, n] of each element the graph one-hots."""
    if not spec.obs_categories:
        return {}
    from services.common.protocol.spaces import describe_observation

    return {"space": describe_observation(spec), "categories": [list(c) for c in spec.obs_categories]}


def export_onnx(trained, path: Path, masked: bool) -> None:
    import torch

    module = trained.greedy()
    example = tuple(torch.from_numpy(x) for x in example_inputs(trained, 2, masked))
    batch = torch.export.Dim("batch")
    with _quiet_exporter():
        program = torch.onnx.export(module, example, None, input_names=input_names(trained, masked),
                                    output_names=output_names(trained), dynamo=True,
                                    dynamic_shapes=tuple({0: batch} for _ in example),
                                    opset_version=OPSET, verbose=False, optimize=True)
        program.model.metadata_props.update(metadata(trained, masked))
        program.save(str(path))


def export_torchscript(trained, path: Path, masked: bool) -> None:
    import torch

    module = trained.greedy()
    example = tuple(torch.from_numpy(x) for x in example_inputs(trained, 2, masked))
    with _quiet_exporter(), torch.no_grad():
        traced = torch.jit.trace(module, example, check_trace=False)
        torch.jit.save(traced, str(path), _extra_files={"kuberl.json": json.dumps(metadata(trained, masked))})


def check(trained, path: Path, fmt: str, masked: bool = False, n: int = CHECK_BATCH) -> float:
    """Load the written file back and compare its actions with the torch policy's on `n` random
    observations (with random masks when `masked`), then on one (batch sizes other than the
    export's example, so the batch dimension is dynamic; one is what a program acting for one agent
    sends). A recurrent policy is stepped through STATE_STEPS observations from the zero state, its
    `next_state` fed back each step, as a program stepping an episode does; actions and states are
    compared at every step. Returns the largest absolute difference; raises ExportError on a mismatch."""
    import torch

    names = input_names(trained, masked)
    outputs = output_names(trained)
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        if (graph := [i.name for i in session.get_inputs()]) != names:
            raise ExportError(f"{path}: has inputs {graph}, the policy takes {names}")

        def run(*inputs: np.ndarray) -> tuple[np.ndarray, ...]:
            return tuple(session.run(outputs, dict(zip(names, inputs))))
    else:
        with _quiet_exporter():
            loaded = torch.jit.load(str(path))

        def run(*inputs: np.ndarray) -> tuple[np.ndarray, ...]:
            with torch.inference_mode():
                out = loaded(*map(torch.from_numpy, inputs))
            return tuple(o.numpy() for o in out) if isinstance(out, tuple) else (out.numpy(),)

    def policy(*inputs: np.ndarray) -> tuple[np.ndarray, ...]:
        with torch.inference_mode():
            out = trained.greedy()(*map(torch.from_numpy, inputs))
        return tuple(o.numpy() for o in out) if isinstance(out, tuple) else (out.numpy(),)

    largest = 0.0
    full = example_inputs(trained, n, masked, seed=1)
    cases = [full, tuple(x[:1] for x in full)]
    if trained.policy.state_size:   # a sequence: each step's state is the last step's next_state
        state = np.zeros_like(full[1][:4])
        for step in range(STATE_STEPS):
            inputs = example_inputs(trained, 4, masked, seed=2 + step)
            inputs = (inputs[0], state, *inputs[2:])
            largest = max(largest, _compare(path, run(*inputs), policy(*inputs)))
            state = run(*inputs)[1]
    for inputs in cases:
        largest = max(largest, _compare(path, run(*inputs), policy(*inputs)))
    return largest


def _compare(path: Path, got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...]) -> float:
    """The largest difference between the file's outputs and the torch policy's; ExportError where
    they differ (any integer action, or floats beyond rtol 1e-4, atol 1e-5)."""
    largest = 0.0
    for name, g, w in zip(("actions", "next states"), got, want):
        if g.shape != w.shape or g.dtype != w.dtype:
            raise ExportError(f"{path}: gives {name} {g.dtype} {list(g.shape)}, the policy {w.dtype} {list(w.shape)}")
        if np.issubdtype(w.dtype, np.integer):
            if (bad := int((g != w).sum())):
                raise ExportError(f"{path}: {bad} of {len(g)} {name} differ from the torch policy's")
            continue
        diff = float(np.abs(g - w).max())
        if not np.allclose(g, w, rtol=1e-4, atol=1e-5):
            raise ExportError(f"{path}: {name} differ from the torch policy's by up to {diff:g}")
        largest = max(largest, diff)
    return largest


def export(trained, fmt: str, path: str | Path, masked: bool = False) -> Path:
    """Write `trained`'s deterministic policy to `path` in `fmt` ("onnx" or "torchscript"), with an
    `action_mask` input when `masked` (see `mask_input`). Blocking."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: not a format written here; use {' or '.join(FORMATS)}")
    if masked and not trained.takes_masks:
        raise ExportError(f"{trained.cfg.algorithm} on {trained.spec.action} takes no action masks")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    (export_onnx if fmt == "onnx" else export_torchscript)(trained, path, masked)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kuberl export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="CHECKPOINT", help="a ckpt-*.pt file, or a run directory (its newest checkpoint)")
    # (no argparse `choices`: an unknown format gets the same one-line error, exit 2, as every other refusal)
    p.add_argument("--format", default="onnx", help=f"{' or '.join(FORMATS)} (default onnx)")
    p.add_argument("-o", "--output", default=None,
                   help="the file to write (default: policy-v<version>.onnx or .pt in the current directory); for "
                        "a run of several policies (config `policies`), the directory to write <policy>-v<version>.onnx "
                        "(or .pt) of each into (default: the current directory)")
    p.add_argument("--action-mask", default="auto", metavar="auto|yes|no",
                   help="give the graph an action_mask input: auto (default) when the run's env reports "
                        "info['action_mask'] on reset")
    p.add_argument("--no-check", action="store_true", help="do not load the file back and compare its actions")
    args = p.parse_args(argv)
    if args.format not in FORMATS:
        print(f"kuberl export: --format {args.format!r}: not a format written here; use {' or '.join(FORMATS)}",
              file=sys.stderr)
        return 2
    if args.action_mask not in MASK_CHOICES:   # (before the checkpoint is read)
        print(f"kuberl export: --action-mask {args.action_mask!r}: use auto, yes or no", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s export: %(message)s")
    import torch

    from services.cli.trained import TrainedPolicyError, load_policies, load_trained, policy_checkpoint_dirs

    torch.set_num_threads(1)
    try:
        if policy_checkpoint_dirs(args.path) is not None:   # a run of several policies: a file for each
            folder = Path(args.output or ".")
            if folder.suffix:
                raise ExportError(f"-o {folder}: a run of several policies is written as one file per policy: "
                                  f"give a directory")
            folder.mkdir(parents=True, exist_ok=True)
            plan = [(t, folder / f"{name}-v{t.version}{FORMATS[args.format]}")
                    for name, t in load_policies(args.path).items()]
        else:
            trained = load_trained(args.path)
            plan = [(trained, Path(args.output or f"policy-v{trained.version}{FORMATS[args.format]}"))]
    except (TrainedPolicyError, ExportError) as err:
        print(f"kuberl export: {err}", file=sys.stderr)
        return 2
    for trained, out in plan:
        if code := _export_one(trained, out, args):
            return code
    return 0


def _export_one(trained, out: Path, args: argparse.Namespace) -> int:
    """Write one policy's file, say what it takes and gives, and check it (unless --no-check)."""
    try:
        masked, note = mask_input(trained, args.action_mask)
        if note:
            print(f"kuberl export: note: {note}", file=sys.stderr)
        export(trained, args.format, out, masked)
    except ExportError as err:
        print(f"kuberl export: {err}", file=sys.stderr)
        return 2
    spec, size = trained.spec, trained.policy.state_size
    state = f"float32 [batch, {size}]"
    print(f"wrote {out} ({out.stat().st_size:,} bytes, {args.format}): {trained.description}\n"
          f"  input  obs     {spec.obs_dtype.name} [batch{''.join(', ' + str(d) for d in spec.obs_shape)}]"
          + (f"  ({_categorical(spec)['space']}, one-hot encoded in the graph)" if spec.obs_categories else "") + "\n"
          + (f"  input  state   {state}  (zeros at an episode's start, else the last next_state)\n" if size else "")
          + (f"  input  action_mask  bool [batch, {spec.action.mask_width}]  (True: allowed)\n"
             if masked else "") +
          f"  output action  {spec.action.dtype.name} [batch{''.join(', ' + str(d) for d in spec.action.shape)}]"
          f"  ({spec.action})"
          + (f"\n  output next_state  {state}" if size else ""))
    if args.no_check:
        return 0
    try:
        diff = check(trained, out, args.format, masked)
    except ExportError as err:
        print(f"kuberl export: {err}", file=sys.stderr)
        return 1
    runtime = "onnxruntime" if args.format == "onnx" else "torch.jit.load"
    print(f"checked: {runtime} gives the torch policy's actions on {CHECK_BATCH} random observations and on one"
          + (f", and its actions and states through {STATE_STEPS} steps with next_state fed back" if size else "")
          + (f" (largest difference {diff:.2g})" if diff else ""))
    return 0
