"""`kuberl config`: the experiment config's reference, generated from the settings dataclasses.

Every key's one-line meaning is the trailing comment on its field's line in the dataclass (continued on
the comment-only lines right below it that are indented past the field or padded after their `#`); a
comment block above a field says why, and is not part of the reference. Types and defaults come from
the annotations and the resolved default config (services/config.py), allowed values and limits from the
`require` checks of each class (a membership test or a comparison of the field with constants).

    kuberl config --defaults        the default config as YAML, a comment above every key
    kuberl config CONFIG            CONFIG resolved (every default filled in), commented alike
    kuberl config --reference       docs/config.md (`make config-docs` writes it; a unit test compares)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from services import algorithms
from services.config import ConfigError, ExperimentConfig, load_config
from services.common.settings import plain

REFERENCE = Path("docs/config.md")
REGENERATE = "make config-docs"
NOT_KEYS = ("sections",)  # CommonConfig fields that are no YAML key (each algorithm's section stands at the top)


@dataclass(frozen=True)
class Key:
    """One key of the experiment config: its dotted path (`<name>` standing for any name of a mapping),
    the class and field it comes from, and what the reference says of it."""
    path: str
    owner: type
    field: str
    type: str
    default: Any          # plain data; REQUIRED where the field has no default
    allowed: str          # from the class's checks ("" where they say nothing simple)
    meaning: str
    section: bool         # a dataclass of keys of its own (the reference gives it a heading)


REQUIRED = object()


# --- meanings: the trailing comment on each field's line ---------------------------------------------

@cache
def _comments(path: str) -> dict[int, tuple[int, str, bool]]:
    """Each line's comment in the file: (its column, its text, whether the line holds only the comment)."""
    source = Path(path).read_text()
    lines = source.splitlines()
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            out[row] = (col, tok.string, lines[row - 1][:col].strip() == "")
    return out


@cache
def _field_lines(cls: type) -> dict[str, tuple[int, int]]:
    """Each field the class itself declares: (its indentation, its last line) in the source file."""
    source, first = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(source)))
    indent = len(source[0]) - len(source[0].lstrip())
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    return {node.target.id: (indent + node.col_offset, first - 1 + (node.end_lineno or node.lineno))
            for node in body.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def _declaring(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))


def meaning(cls: type, name: str) -> str:
    """The one-line meaning of field `name` of the settings class `cls` ("" if its line has no comment)."""
    owner = _declaring(cls, name)
    indent, line = _field_lines(owner)[name]
    comments = _comments(inspect.getsourcefile(owner) or "")
    col, text, alone = comments.get(line, (0, "", True))
    if alone:
        return ""
    parts = [text[1:].strip()]
    while (nxt := comments.get(line := line + 1)) is not None and nxt[2] and (
            nxt[0] > indent or nxt[1].startswith("#  ")):
        parts.append(nxt[1][1:].strip())
    return " ".join(p for p in parts if p)


# --- limits: what the class's `require` checks say of one field alone ---------------------------------

_OPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}


def _field_of(node: ast.AST) -> str | None:
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
        return node.attr
    return None


def _constant(node: ast.AST, scope: Mapping[str, Any]) -> Any:
    """The value of a literal or of a module-level name; LookupError for anything else."""
    if isinstance(node, ast.Name) and node.id in scope:
        return scope[node.id]
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise LookupError from None


def _limit(node: ast.AST, scope: Mapping[str, Any]) -> tuple[str, str] | None:
    """(field, what it must be) for a check of one field against constants, else None."""
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and len(node.values) == 2:
        none, other = node.values
        if (isinstance(none, ast.Compare) and isinstance(none.ops[0], ast.Is) and len(none.ops) == 1
                and isinstance(none.comparators[0], ast.Constant) and none.comparators[0].value is None
                and (name := _field_of(none.left)) and (rest := _limit(other, scope)) and rest[0] == name):
            return name, f"null or {rest[1]}"
        return None
    if not isinstance(node, ast.Compare):
        return None
    try:
        if len(node.ops) == 1 and isinstance(node.ops[0], ast.In) and (name := _field_of(node.left)):
            values = _constant(node.comparators[0], scope)
            return name, " | ".join("null" if v is None else str(v) for v in values)
        terms = [node.left, *node.comparators]
        names = [_field_of(t) for t in terms]
        if len([n for n in names if n]) != 1 or not all(type(op) in _OPS for op in node.ops):
            return None
        name = next(n for n in names if n)
        values = [name if n else repr(_constant(t, scope)) for t, n in zip(terms, names)]
    except LookupError:
        return None
    ops = [_OPS[type(op)] for op in node.ops]
    if len(values) == 3 and ops == ["<=", "<="]:
        return name, f"{values[0]}..{values[2]}"
    if len(values) == 2 and values[0] == name:
        return name, f"{ops[0]} {values[1]}"
    return name, " ".join(v for pair in zip(values, [*ops, ""]) for v in pair).strip()


@cache
def limits(cls: type) -> dict[str, str]:
    """Per field, what the checks of `cls` and its bases (`require(...)` in any method) say it must be,
    where a check is a membership or a comparison of that field alone against constants."""
    out: dict[str, list[str]] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        scope = vars(sys.modules[klass.__module__])
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "require"):
                continue
            cond = call.args[0]
            for term in cond.values if isinstance(cond, ast.BoolOp) and isinstance(cond.op, ast.And) else [cond]:
                if (found := _limit(term, scope)) is not None and found[1] not in out.setdefault(found[0], []):
                    out[found[0]].append(found[1])
    return {name: ", ".join(said) for name, said in out.items()}


# --- the keys -----------------------------------------------------------------------------------------

def _settings_class(tp: Any) -> type | None:
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        return f"list[{_type_name(args[0])}]"
    if origin in (dict, Mapping):
        return f"map[{_type_name(args[0])}, {_type_name(args[1])}]"
    if _settings_class(tp) is not None:
        return "section"
    return getattr(tp, "__name__", str(tp))


def _walk(cls: type, prefix: str, value: Any) -> Iterator[Key]:
    """The keys of settings class `cls` under `prefix`, their defaults from `value` (an instance, or
    None for the class's own defaults)."""
    hints = typing.get_type_hints(cls)
    said = limits(cls)
    for f in dataclasses.fields(cls):
        if f.name in NOT_KEYS:
            continue
        tp = hints[f.name]
        if value is not None:
            default = plain(getattr(value, f.name))
        elif f.default is not dataclasses.MISSING:
            default = plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = plain(f.default_factory())
        else:
            default = REQUIRED
        path = f"{prefix}{f.name}"
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        nested = _settings_class(tp) or (_settings_class(inner[0]) if len(inner) == 1 else None)
        entries = (_settings_class(typing.get_args(tp)[1]) if typing.get_origin(tp) in (dict, Mapping) else None)
        yield Key(path, cls, f.name, _type_name(tp), default, said.get(f.name, ""), meaning(cls, f.name),
                  section=nested is not None or entries is not None)
        if nested is not None:
            yield from _walk(nested, f"{path}.", getattr(value, f.name) if value is not None else None)
        elif entries is not None:
            yield from _walk(entries, f"{path}.<name>.", None)


def _summary(cls: type) -> str:
    """The first line of the docstring of the module that defines `cls` (an algorithm's config.py)."""
    return (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]


def keys(cfg: ExperimentConfig | None = None) -> list[Key]:
    """Every key of the experiment config in the YAML file's order (ExperimentConfig.to_dict's: each
    algorithm's section after `env`), the defaults those of `cfg` (None: the default config)."""
    cfg = ExperimentConfig() if cfg is None else cfg
    groups: dict[str, list[Key]] = {}
    for key in _walk(ExperimentConfig, "", cfg):
        if key.path == "algorithm":
            key = dataclasses.replace(key, allowed=" | ".join(algorithms.REGISTRY))
        groups.setdefault(key.path.split(".")[0], []).append(key)
    for name, algorithm in algorithms.REGISTRY.items():
        section = Key(name, algorithm.settings, "", "section", plain(cfg.section(name)), "",
                      _summary(algorithm.settings), section=True)
        groups[name] = [section, *_walk(algorithm.settings, f"{name}.", cfg.section(name))]
    return [key for top in cfg.to_dict() for key in groups[top]]


# --- rendering ----------------------------------------------------------------------------------------

def _flow(value: Any) -> str:
    """`value` as one line of YAML (flow style)."""
    if value is REQUIRED:
        return "(required)"
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return text.removesuffix("...").strip()


def _note(key: Key) -> str:
    return key.meaning + (f" [{key.allowed}]" if key.allowed else "")


def commented_yaml(cfg: ExperimentConfig | None = None) -> str:
    """The config (None: the default one) as YAML with every default filled in and each key's meaning,
    and its allowed values in brackets, in a comment above it. `yaml.safe_load` of it gives cfg.to_dict()."""
    found = keys(cfg)
    lines = ["# The experiment config with every key at its value (kuberl config). What each key means, its",
             "# type and the values allowed: docs/config.md.", ""]
    inside = "-"   # the key whose own keys are not listed one by one (a mapping of sections, a null section)
    for key in found:
        if key.path.startswith(inside + "."):
            continue
        depth = key.path.count(".")
        pad = "  " * depth
        if depth == 0 and lines[-1] != "":
            lines.append("")
        lines.extend(pad + "# " + line for line in textwrap.wrap(_note(key), 110 - len(pad)))
        name = key.path.rsplit(".", 1)[-1]
        mapping = key.type.startswith("map[")
        if key.section and not mapping and isinstance(key.default, dict):   # its keys follow, commented
            lines.append(f"{pad}{name}:")
            continue
        inside = key.path
        if mapping and key.default:
            block = yaml.safe_dump(key.default, sort_keys=False, default_flow_style=False, width=10**9)
            lines.append(f"{pad}{name}:")
            lines.extend(f"{pad}  {line}" for line in block.splitlines())
        else:
            lines.append(f"{pad}{name}: {_flow(key.default)}")
    return "\n".join(lines) + "\n"


PREAMBLE = """\
# The experiment config

<!-- Generated from the settings dataclasses by `make config-docs` (kuberl config --reference): do not
edit. A key's meaning is the comment on its field's line (services/common/config/, services/common/net/tls.py
and auth.py, services/algorithms/<name>/config.py); tests/unit/common/test_config_reference.py fails when
this file is out of date or a key has no meaning. -->

One YAML file configures a run, and every role reads its part of the same file. Every key is optional:
a key left out takes the default below, and an unknown key, a wrong type or an impossible value stops
the process with an error naming the key. `kuberl config --defaults` prints the whole default config
as YAML, each key's meaning in a comment above it; `kuberl config CONFIG` prints CONFIG so, every
default filled in (what `kuberl up` writes beside the run as config.yaml).

What people trip over:

- **When a run ends.** `kuberl up` stops at the first of: the mean return over `run.return_window`
  (100) episodes reaching `run.target_return` (475.0, CartPole's), `run.max_env_steps` env steps, all
  actors together (default 1,000,000), or `run.max_seconds` of wall time (default null: no limit).
  On an env whose returns never reach 475 the run therefore ends after 1,000,000 env steps; set
  `run.target_return: null` and a step budget of your own to train for as long as you mean to.
- **Env copies.** Each actor steps `env.num_envs` copies of the env (default 8) in one vector env.
- **Custom envs.** `env.id: module:EnvId` makes gymnasium import `module` (which registers `EnvId`)
  before it makes the env. Every process that makes the env imports it, `kuberl up` itself (it checks the
  env's spaces), each actor and `kuberl eval`: run them where `module` is importable, e.g. with
  `PYTHONPATH=.` from the directory that holds it, and put it in the image on Kubernetes.
- **PPO's switches.** `norm_adv` normalises advantages to mean 0 and std 1 in each minibatch;
  `clip_vloss` takes as value loss the larger of the new value's squared error and that of the old value
  moved toward the new by at most `clip_coef`;
  `normalize_rewards` divides rewards by the running std of the discounted return and clips them to
  +-`reward_clip`; `anneal_updates` (null: off) lowers the learning rate, and with `anneal_clip` the
  clip range `clip_coef`, linearly to 0 over that many learner updates. A fragment more than
  `max_policy_lag` updates behind is stale: trained on with V-trace targets (`stale_fragments:
  correct`; the importance weights truncated at `vtrace_rho_bar`, the traces at `vtrace_c_bar`) or
  dropped. With `decoupled` the others are clipped around the policy at the start of the update
  (pi_prox) rather than the one that acted (mu), each sample weighted by pi_prox/mu truncated at
  `decoupled_rho_bar`.

Columns: the key (dotted; `<name>` is a name you choose), its type (`list[...]` is a YAML list,
`map[...]` a mapping, `null` the YAML null), its default, the values or limits its checks allow where
they are simple, and what it means.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _owner(found: dict[str, Key], path: str) -> str:
    """The section whose table lists `path`: the nearest section key above it ("" for the top level)."""
    parts = path.split(".")[:-1]
    while parts and not (".".join(parts) in found and found[".".join(parts)].section):
        parts.pop()
    return ".".join(parts)


def markdown(found: list[Key] | None = None) -> str:
    """docs/config.md: a heading per section, a table of its keys."""
    found = keys() if found is None else found
    by_path = {k.path: k for k in found}
    rows: dict[str, list[Key]] = {}
    for key in found:
        if not key.section or typing.get_origin(key.default) is None:
            rows.setdefault(_owner(by_path, key.path), []).append(key)
    out = [PREAMBLE, "## Contents", ""]
    sections = [k for k in found if k.section]
    depth = {k.path: _depth(by_path, k.path) for k in sections}
    out += [f"{'  ' * depth[k.path]}- [`{k.path}`](#{_anchor(k.path)})" for k in sections]
    out.append("")
    for owner in ["", *(k.path for k in sections)]:
        if owner:
            key = by_path[owner]
            out += [f"{'#' * (2 + depth[owner])} `{owner}`", "", _section_text(key), ""]
        else:
            out += ["## Top level", ""]
        table = [k for k in rows.get(owner, []) if not k.section]
        if table:
            out += ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
            out += [f"| `{k.path}` | {_cell(k.type)} | `{_cell(_flow(k.default))}` | {_cell(k.allowed)} | "
                    f"{_cell(k.meaning)} |" for k in table]
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def _depth(found: dict[str, Key], path: str) -> int:
    """How many sections hold the section `path`."""
    return 0 if not (owner := _owner(found, path)) else 1 + _depth(found, owner)


def _anchor(path: str) -> str:
    return "".join(c for c in path.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def _section_text(key: Key) -> str:
    """What the reference says under a section's heading: its meaning, its default where that is not a
    set of keys (null, an empty mapping), and its class's docstring."""
    cls = key.owner if not key.field else typing.get_type_hints(key.owner)[key.field]
    args = [a for a in typing.get_args(cls) if a is not type(None)]
    settings = _settings_class(cls) or next((_settings_class(a) for a in reversed(args) if _settings_class(a)), None)
    doc = inspect.cleandoc(settings.__doc__ or "") if settings is not None else ""
    lead = key.meaning
    if not isinstance(key.default, dict) or not key.default:
        lead += f" (default: `{_flow(key.default)}`)"
    return "\n\n".join(p for p in (lead.strip(), doc) if p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kuberl config", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group()
    what.add_argument("config", nargs="?", help="an experiment config to print resolved (default: --defaults)")
    what.add_argument("--defaults", action="store_true", help="print the default config (the default)")
    what.add_argument("--reference", action="store_true", help="print the reference, docs/config.md")
    args = p.parse_args(argv)
    if args.reference:
        sys.stdout.write(markdown())
        return 0
    try:
        cfg = load_config(args.config)
    except (ConfigError, OSError) as err:
        print(f"kuberl config: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(commented_yaml(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
