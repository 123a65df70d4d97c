"""DP-Forward (Du et al., "DP-Forward: Fine-tuning and Inference on Language Models with
Differential Privacy in Forward Pass", arXiv:2309.06746) next to DP-SGD on Amazon Games, and an
inversion check on tiny data.

    python benchmarks/dp_forward.py [--data ../shared/data/amazon-video-games/Video.txt]
        [--epsilons 1 4 8] [--methods dp-forward dp-sgd non-private] [--epochs 20]
        [--batch-size 1024] [--learning-rate 5e-3] [--results runs.jsonl]

Preprocesses `Video.txt` once (as `dpformer_amazon.py`: SASRec format, last item held out, δ = 1/N
users), then runs `dprec train seqrec` once per (method, ε) in its own process, so each run's
peak resident memory (`ru_maxrss`) is its own, and prints NDCG@10 / HIT@10 (full ranking over all
items), s/step (the summary's, first step excluded) and peak RSS. The two privacy columns do not
mean the same thing: DP-SGD's ε is **central** user-level (ε, δ)-DP of the trained model;
DP-Forward's is **SeqLDP**, local DP of each user's sequence given its next-item label (sent in
the clear), over all its epoch releases, and evaluation queries are noised too (each its own
(ε_query, δ)-LDP release). `dp-forward-trusted` updates the encoder from raw-sequence gradients
as the paper's experiments do (needs a trusted party; not covered by SeqLDP);
`dp-forward-on-device` evaluates on clean representations, which is private only if the user
scores the items on their own device. `-last` rows score the last position only, as DP-Forward
must (its earlier labels would reveal the sequence): the like-for-like rows for step time and
memory.

    python benchmarks/dp_forward.py --inversion [--epsilons 1 4 8]

instead trains a small model without privacy on tiny synthetic sequences and measures, at each ε
(one release, δ = 1e-5, aGM σ), how well an attacker who knows the model recovers the clean
input from the noised release (Du et al. 2023, §6, Table 8): the nearest-item recall of the input
items from the noised, normalised L×d embedding matrix, and the rate at which a noised user
representation (1×d) is closest to its own clean representation among all users'.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

METHODS = {
    "dp-forward": (["--dp-forward"], "SeqLDP per user (local; label in the clear)"),
    "dp-forward-trusted": (["--dp-forward", "--forward-encoder-updates", "trusted"],
                           "SeqLDP of the representations; encoder gradients need a trusted "
                           "party"),
    "dp-forward-on-device": (["--dp-forward", "--no-inference-noise"],
                             "SeqLDP in training; test users scored on their device (the item "
                             "table sent to them), else inference is not private"),
    "dp-sgd": (["--no-reattention", "--normalize"], "central user-level (ε, δ)-DP"),
    "dp-sgd-last": (["--no-reattention", "--normalize", "--loss-positions", "last"],
                    "central user-level (ε, δ)-DP"),
    "non-private": (["--no-reattention"], "none"),
    "non-private-last": (["--no-reattention", "--loss-positions", "last"], "none"),
}


def preprocess(source, work_dir):
  from dpformer_amazon import preprocess as amazon
  return amazon(source, work_dir)


def run_training(argv):
  """`dprec train seqrec ARGV` in a child process: (summary, wall seconds, peak RSS MiB)."""
  with tempfile.TemporaryDirectory() as tmp:
    summary_path = os.path.join(tmp, "summary.json")
    command = [sys.executable, "-m", "dprec.cli", "train", "seqrec", "--no-progress",
               "--summary-json", summary_path, *argv]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
      raise SystemExit(f"{' '.join(command)} failed with exit code {child.returncode}")
    with open(summary_path, encoding="utf-8") as summary:
      return json.load(summary), wall, usage.ru_maxrss / 1024


def utility(args):
  data_dir = preprocess(args.data, args.work_dir)
  lines = [f"epochs={args.epochs} B={args.batch_size} lr={args.learning_rate:g} L={args.max_len} "
           f"d={args.dim} reduced_dim={args.reduced_dim}; DP-SGD: all positions (-last: the last "
           "only, as DP-Forward), normalisation C/(‖g‖+0.01), Poisson; "
           "DP-Forward: last position, C = 1, noise on the user representation, noised "
           "evaluation", "",
           "| method | guarantee | ε | NDCG@10 | HIT@10 | s/step | steps | wall s | peak RSS MiB |",
           "|---|---|---|---|---|---|---|---|---|"]
  runs = [(m, eps) for m in args.methods if not m.startswith("non-private")
          for eps in args.epsilons]
  runs += [(m, float("inf")) for m in args.methods if m.startswith("non-private")]
  for method, eps in runs:
    extra, guarantee = METHODS[method]
    if args.reduced_dim and "--dp-forward" in extra:
      extra = extra + ["--forward-reduced-dim", str(args.reduced_dim)]
    argv = ["--data", data_dir, "--epsilon", f"{eps:g}", "--epochs", str(args.epochs),
            "--batch-size", str(args.batch_size), "--learning-rate", str(args.learning_rate),
            "--max-len", str(args.max_len), "--dim", str(args.dim), "--seed", str(args.seed),
            *extra]
    summary, wall, peak = run_training(argv)
    summary.update(method=method, wall_seconds=wall, peak_rss_mib=peak)
    if args.results:
      with open(args.results, "a", encoding="utf-8") as out:
        out.write(json.dumps(summary) + "\n")
    seconds = 1 / summary["steps_per_second"] if summary.get("steps_per_second") else float("nan")
    lines.append(f"| {method} | {guarantee} | {eps:g} | {100 * summary['ndcg_at_10']:.2f} | "
                 f"{100 * summary['hit_at_10']:.2f} | {seconds:.2f} | {summary['steps']} | "
                 f"{wall:.0f} | {peak:.0f} |")
    print(lines[-1], file=sys.stderr, flush=True)
  return "\n".join(lines)


def tiny_model(args, work_dir):
  """A small seqrec model trained without privacy on synthetic sequences, and its examples."""
  import tensorflow as tf
  from dprec.data.sequences import load_sequences
  from dprec.data.synthetic import generate_sequences
  from dprec.data.sequences import make_examples
  from dprec.workflows import seqrec
  from pipelines import sequences
  source = os.path.join(work_dir, "tiny.txt")
  generate_sequences(source, users=args.tiny_users, items=args.tiny_items, seed=0, progress=False)
  out = os.path.join(work_dir, "tiny")
  sequences.run(sequences.SequencesJob(inputs=(source,), input_format="sasrec", output=out))
  examples = make_examples(load_sequences(out), 20)
  options = seqrec.SeqRecTrainOptions(model="dpformer", epsilon=float("inf"),
                                      epochs=args.tiny_epochs, batch_size=64, max_len=20,
                                      dim=32, num_blocks=1, dropout=0.1, reattention=False,
                                      progress=False)
  tf.keras.utils.set_random_seed(0)
  model = seqrec.build_model(options, examples,
                             seqrec.plan_privacy(options, len(examples.items)))
  model.fit({"items": examples.items}, examples.labels, batch_size=64, epochs=args.tiny_epochs,
            verbose=0)
  return model, examples


def cosine(a, b):
  a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
  b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
  return a @ b.T


def inversion(args):
  import tensorflow as tf
  from dprec.layers.forward_noise import ForwardNoise
  from dprec.privacy import analytic_gaussian
  with tempfile.TemporaryDirectory() as work_dir:
    model, examples = tiny_model(args, work_dir)
  histories = examples.test_histories
  valid = histories > 0
  table = model.item_embedding.embeddings.numpy()
  lookups = table[histories] * valid[..., None]
  items = histories[valid]
  users = model.forward(histories, last_only=True)[1].numpy()  # clean user representations
  lines = [f"tiny synthetic data: {len(histories)} users, {examples.num_items} items, L = 20, "
           f"d = 32, trained {args.tiny_epochs} epochs without privacy; one release per ε, "
           "δ = 1e-5, C = 1 (sensitivity 2), aGM σ", "",
           "| ε | σ | input items recovered (NN on the noised L×d embeddings) | "
           "user re-identified (noised 1×d representation) | cos(noised, clean) user |",
           "|---|---|---|---|---|",
           f"| chance | — | {1 / examples.num_items:.3f} | {1 / len(users):.3f} | — |"]
  for eps in list(args.epsilons) + [float("inf")]:
    multiplier = (0.0 if not np.isfinite(eps)
                  else analytic_gaussian.analytic_gaussian_sigma(eps, 1e-5, 1.0))
    noise = ForwardNoise(1.0, multiplier, generator=tf.random.Generator.from_seed(1))
    released = noise(tf.constant(lookups, tf.float32), training=True).numpy()
    nearest = np.argmax(cosine(released[valid], table[1:]), axis=1) + 1
    item_recall = float(np.mean(nearest == items))
    released_users = noise(tf.constant(users), training=True).numpy()
    similarity = cosine(released_users, users)
    reidentified = float(np.mean(np.argmax(similarity, axis=1) == np.arange(len(users))))
    lines.append(f"| {eps:g} | {multiplier * 2:.3f} | {item_recall:.3f} | {reidentified:.3f} | "
                 f"{float(np.mean(np.diag(similarity))):.3f} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", default=os.path.join(
      os.path.dirname(__file__), "..", "..", "shared", "data", "amazon-video-games", "Video.txt"))
  parser.add_argument("--work-dir", default="/tmp/dprec_amazon")
  parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 8.0])
  parser.add_argument("--methods", nargs="+", default=["dp-forward", "dp-sgd", "non-private"],
                      choices=list(METHODS))
  parser.add_argument("--epochs", type=int, default=20)
  parser.add_argument("--batch-size", type=int, default=1024)
  parser.add_argument("--learning-rate", type=float, default=5e-3)
  parser.add_argument("--max-len", type=int, default=50)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--reduced-dim", type=int, default=None,
                      help="DP-Forward: trainable projection to this dimension before the noise")
  parser.add_argument("--results", default=None, help="append one JSON summary per run here")
  parser.add_argument("--inversion", action="store_true",
                      help="run the inversion check on tiny synthetic data instead")
  parser.add_argument("--tiny-users", type=int, default=500)
  parser.add_argument("--tiny-items", type=int, default=200)
  parser.add_argument("--tiny-epochs", type=int, default=5)
  args = parser.parse_args(argv)
  print(inversion(args) if args.inversion else utility(args))


if __name__ == "__main__":
  main()
