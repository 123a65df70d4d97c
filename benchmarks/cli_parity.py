"""The guides' commands at two commits: what a user reads of them, diffed.

Runs each guide's main example (the first shell block of docs/guide/*.md, in a fresh directory,
sized down and with its setup step, exactly as tests/test_guides.py runs it) and the README's
runnable command blocks, on tiny synthetic data, with `--insecure-noise-seed 0` on every
command whose noise, sampling or selection would otherwise come from a secret key (so that the
output is deterministic), in a snapshot (`git archive`) of each commit. Then it compares what the
commands print (result lines, notes, warnings, refusals) and every JSON file they write
(summaries, ledgers, manifests), ignoring volatile fields: times and durations, steps/s, run
ids and hashes, paths. The commands and their sizes are the HEAD commit's for both sides, so a
difference is one of behaviour, not of the guides' text. Exit status 1 when anything differs.

  python benchmarks/cli_parity.py --base main --head HEAD [--only stream,README] [--keep DIR]

`dprec audit` has no public seed (its canaries are always secret), so its measured bounds and
scores differ from run to run: they are listed under `AUDIT_RANDOM` and compared by presence.
"""
import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED = "--insecure-noise-seed 0"
# Commands that take a public seed for their secret draws (the rest draw none, or are audit's).
SEEDED = ("dprec train ctr", "dprec train seqrec", "dprec stream", "dprec demo")
# Deterministic threads, ops and hashing: the same seed then gives the same bits.
ENV = {"TF_DETERMINISTIC_OPS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
       "PYTHONHASHSEED": "0", "CUDA_VISIBLE_DEVICES": ""}
# README blocks that cannot run here: remote runners, placeholders, a live stream (the stream
# guide runs the same commands).
SKIP_README = re.compile(r"DataflowRunner|DaskRunner| \.\.\. |--idle-timeout 600|^make ", re.M)
VOLATILE_KEYS = re.compile(r"time|seconds|per_second|^run_id$|^run_dir$|^updated$|^created$|"
                           r"^pid$|^host|^python$|^versions?$|^stack$")
AUDIT_RANDOM = re.compile(r"epsilon_lower|score|p_value|bound|auc|loss|accuracy|canar")
MASKS = [
    # run ids, data set ids (the guides' gzip files hold their time: their ids differ), hashes
    (re.compile(r"\b(?=[0-9]*[a-f])[0-9a-f]{8,64}(?:\b|…)"), "<ID>"),
    # a JSON line's volatile field (a summary printed on stdout)
    (re.compile(r'("[a-z_]*(?:time|seconds|per_second)[a-z_]*": )[^,}\n]+'), r"\1<V>"),
    (re.compile(r"\d+(?:\.\d+)?\s?(?:s|ms|min|seconds|minutes)\b"), "<TIME>"),
    (re.compile(r"[\d.]+\s?k?[a-z]*/s\b"), "<RATE>"),  # steps/s, rows/s, tqdm's 40.9krow/s
    (re.compile(r"steps/s=\S+"), "steps/s=<RATE>"),
    (re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d\S*"), "<DATE>"),
    (re.compile(r"\b\d\d:\d\d(?::\d\d)?\b"), "<CLOCK>"),
    (re.compile(r"\b(?:pid|process) \d+"), "pid <N>"),
]


def load(path):
  spec = importlib.util.spec_from_file_location(Path(path).stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def snapshot(rev, destination):
  """The tree of `rev` (no .git) in `destination`."""
  destination.mkdir(parents=True)
  archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                           capture_output=True).stdout
  subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)


def seeded(script):
  """`script` with the public seed on every command that would draw from a secret key."""
  lines = []
  for line in script.splitlines():
    command, hash_, comment = line.partition("  #")
    stripped = command.rstrip()
    if any(stripped.lstrip().startswith(name) for name in SEEDED) or (
        stripped.lstrip().startswith("dprec preprocess criteo") and "dp_top_k" in stripped):
      background = stripped.endswith("&")
      stripped = stripped.rstrip("&").rstrip() + f" {SEED}" + (" &" if background else "")
    lines.append(stripped + (hash_ + comment if hash_ else ""))
  return "\n".join(lines) + "\n"


def cases(guides_module):
  """{name: shell script}: each guide's main example with its setup, and the README's blocks."""
  found = {}
  for path in sorted(guides_module.GUIDES.glob("*.md")):
    guide = path.stem
    body = guides_module.runnable(guides_module.main_example(guide))
    found[guide] = f"set -e\n{guides_module.SETUP.get(guide, '')}\n{seeded(body)}"
  blocks = [block for block in guides_module.shell_blocks(guides_module.ROOT / "README.md")
            if "dprec " in block and not SKIP_README.search(block)]
  found["README"] = "set -e\n" + "".join(seeded(guides_module.runnable(b)) for b in blocks)
  return found


def normalise_text(text, replacements):
  for old, new in replacements:
    text = text.replace(old, new)
  for pattern, mask in MASKS:
    text = pattern.sub(mask, text)
  return text


def flatten(value, prefix, replacements, audit):
  """{key path: normalised scalar} of a JSON value, volatile keys left out."""
  if isinstance(value, dict):
    out = {}
    for key, item in value.items():
      if VOLATILE_KEYS.search(str(key)):
        continue
      path = f"{prefix}.{key}"
      if audit and AUDIT_RANDOM.search(str(key)):
        out[path] = "<random: present>"
        continue
      out.update(flatten(item, path, replacements, audit))
    return out
  if isinstance(value, list):
    out = {f"{prefix}[]": len(value)}
    for i, item in enumerate(value):
      out.update(flatten(item, f"{prefix}[{i}]", replacements, audit))
    return out
  if isinstance(value, float):
    return {prefix: "nan" if math.isnan(value) else f"{value:.6g}"}
  if isinstance(value, str):
    return {prefix: normalise_text(value, replacements)}
  return {prefix: value}


def run_case(tree, name, script, workdir):
  """Runs `script` in a fresh `workdir` with `tree`'s dprec (its output kept beside it as
  NAME.log); (seconds, output lines, JSON fields)."""
  workdir.mkdir(parents=True)
  env = dict(os.environ, **ENV, PYTHONPATH=str(tree),
             PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
  started = time.monotonic()
  done = subprocess.run(["bash", "-c", script], cwd=workdir, env=env, capture_output=True,
                        text=True, timeout=3000)
  seconds = time.monotonic() - started
  log = workdir.parent / f"{name}.log"
  log.write_text(f"{done.stdout}{done.stderr}\nexit status {done.returncode}\n", "utf-8")
  return (seconds, *collect(tree, name, workdir))


def collect(tree, name, workdir):
  """(output lines, JSON fields) of a case run in `workdir` (normalised)."""
  replacements = [(str(workdir), "<DIR>"), (str(tree), "<TREE>")]
  text = (workdir.parent / f"{name}.log").read_text(encoding="utf-8")
  lines = [normalise_text(line, replacements) for line in text.splitlines() if line.strip()]
  files = {}
  for path in sorted(workdir.rglob("*.json")):
    relative = path.relative_to(workdir)
    if {"secret", "checkpoints", "tensorboard"} & set(relative.parts):
      continue
    try:
      value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
      value = {"unreadable JSON": path.read_text(encoding="utf-8")[:200]}
    files.update(flatten(value, str(relative), replacements,
                         audit=name == "audit" or "audit" in relative.parts))
  return lines, files


def compare(name, base, head):
  """Lines describing the differences of one case (empty when none)."""
  import difflib
  out = []
  if base[1] != head[1]:
    out += [f"  output: {line}" for line in difflib.unified_diff(
        base[1], head[1], "base", "head", lineterm="", n=1)]
  for key in sorted(set(base[2]) | set(head[2])):
    old, new = base[2].get(key, "<absent>"), head[2].get(key, "<absent>")
    if old != new:
      out.append(f"  {key}: {old} -> {new}")
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--base", default="main", help="the commit before (default main)")
  parser.add_argument("--head", default="HEAD", help="the commit after (default HEAD)")
  parser.add_argument("--only", default=None,
                      help="comma-separated cases (guide names, README); default all")
  parser.add_argument("--keep", default=None,
                      help="keep the snapshots and run directories here (default: a temporary "
                      "directory, removed)")
  parser.add_argument("--compare-only", action="store_true",
                      help="compare the runs kept in --keep again (after changing the masks)")
  args = parser.parse_args(argv)
  if args.compare_only and not args.keep:
    parser.error("--compare-only reads the runs of --keep DIR")
  root = Path(args.keep or tempfile.mkdtemp(prefix="cli_parity_"))
  trees = {side: root / side / "tree" for side in ("base", "head")}
  if not args.compare_only:
    for side, rev in (("base", args.base), ("head", args.head)):
      snapshot(rev, trees[side])
  guides = load(trees["head"] / "tests" / "test_guides.py")
  selected = cases(guides)
  if args.only:
    wanted = args.only.split(",")
    unknown = set(wanted) - set(selected)
    if unknown:
      parser.error(f"unknown case(s) {sorted(unknown)}; choose from {sorted(selected)}")
    selected = {name: selected[name] for name in wanted}
  different, total = 0, {"base": 0.0, "head": 0.0}
  started = time.monotonic()
  for name, script in selected.items():
    if args.compare_only:
      results = {side: (0.0, *collect(trees[side], name, root / side / "runs" / name))
                 for side in ("base", "head")}
    else:
      results = {side: run_case(trees[side], name, script, root / side / "runs" / name)
                 for side in ("base", "head")}
    for side in total:
      total[side] += results[side][0]
    lines = compare(name, results["base"], results["head"])
    seconds = ", ".join(f"{side} {results[side][0]:.0f} s" for side in ("base", "head"))
    print(f"{name}: {'DIFFERENT' if lines else 'same'} ({len(results['head'][1])} output lines, "
          f"{len(results['head'][2])} JSON fields; {seconds})", flush=True)
    for line in lines:
      print(line)
    different += bool(lines)
  print(f"{len(selected) - different} of {len(selected)} cases the same ({args.base} vs "
        f"{args.head}); {time.monotonic() - started:.0f} s in all (base {total['base']:.0f} s, "
        f"head {total['head']:.0f} s)")
  if not args.keep:
    shutil.rmtree(root, ignore_errors=True)
  return 1 if different else 0


if __name__ == "__main__":
  sys.exit(main())
