"""The one line a command ends with (`dprec.workflows.run.report` prints it): the headline
metric with its unit beside its baseline, ε spent with the unit it protects, and δ.

`train ctr` and `stream`: held-out AUC beside chance (0.5) and log loss (nats per example)
beside the constant predictor at the held-out click rate. `train seqrec`: NDCG@10 and HIT@10 in
% beside a uniformly random ranking of the M items (HIT@10 = 10/M, NDCG@10 =
(1/M)·Σ_{r=1..10} 1/log2(r + 1)).
"""
import math


def privacy(summary: dict, unit: str) -> str:
  """ε spent per `unit` (with the budget) and δ; "not private" where it is not."""
  epsilon, budget = summary.get("epsilon"), summary.get("epsilon_budget",
                                                        summary.get("epsilon_total"))
  if epsilon is None or not math.isfinite(epsilon):
    return "not private (ε = ∞)"
  text = f"ε = {epsilon:.4g} per {unit}"
  if budget is not None and math.isfinite(budget):
    text += f" (budget {budget:g})"
  text += f", δ = {summary['delta']:.2g}"
  return text if summary.get("private", True) else f"{text}, NOT private (see privacy_note)"


def _ctr_metrics(auc, log_loss, base_rate_log_loss) -> str:
  text = f"AUC {auc:.4f} (chance 0.5), log loss {log_loss:.4f} nats"
  if base_rate_log_loss is not None:
    text += f" (constant at the held-out click rate: {base_rate_log_loss:.4f})"
  return text


def train_ctr(summary: dict) -> str:
  return (f"train ctr {summary['algorithm']}: held-out "
          + _ctr_metrics(summary["auc"], summary["eval_log_loss"], summary["base_rate_log_loss"])
          + "; " + privacy(summary, "training user" if summary.get("privacy_unit") == "user"
                           else "training row"))


def stream(summary: dict) -> str:
  evaluated = [row for row in summary["periods"] if row.get("auc") is not None]
  head = f"stream {summary.get('algorithm')}: {summary['periods_trained']} periods trained"
  if evaluated:
    last = evaluated[-1]
    head += (f"; on period {last['eval_period']} (held out): "
             + _ctr_metrics(last["auc"], last["log_loss"], summary.get("base_rate_log_loss")))
  unit = "user" if summary.get("privacy_unit") == "user" else "row"
  return head + "; " + privacy(summary, unit)


def random_ranking(items: int, k: int = 10) -> dict:
  """NDCG@k and HIT@k (fractions) of ranking `items` items uniformly at random."""
  k = min(k, items)
  return {"ndcg": sum(1 / math.log2(r + 1) for r in range(1, k + 1)) / items, "hit": k / items}


def train_seqrec(summary: dict) -> str:
  chance = random_ranking(summary["items"])
  return (f"train seqrec {summary['model']}: NDCG@10 {100 * summary['ndcg_at_10']:.2f}% "
          f"(random ranking {100 * chance['ndcg']:.2f}%), HIT@10 "
          f"{100 * summary['hit_at_10']:.2f}% (random {100 * chance['hit']:.2f}%) over "
          f"{summary['test_users']:,} test users; "
          + privacy(summary, f"user ({summary['privacy_notion']})" if "privacy_notion" in summary
                    else "user"))
