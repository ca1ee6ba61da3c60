"""jax_ep.train (the example training run) on CPU: a short run lowers the
loss and writes its JSON and PNG; the layer's options run through it (SwiGLU
experts, bf16 against FP8 from the same start, compared on a held-out eval,
learning-rate schedules); --help shows the defaults; two
processes (jax.distributed, gloo collectives, 4 CPU devices each) train in
step with each other and with one process of 8 devices."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np

from jax_ep import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--layers", "1", "--batch", "8", "--seq", "16"]


def test_make_batch_follows_the_task_rule():
  perm = train.task_permutation(32, seed=3)
  x = train.make_batch(np.random.default_rng(0), perm, batch=4, seq=20)
  assert x.shape == (4, 21) and x.dtype == np.int32
  np.testing.assert_array_equal(x[:, 2:], (perm[x[:, 1:-1]] + x[:, :-2] % 2) % 32)
  assert len(np.unique(x)) > 8


def test_a_short_run_lowers_the_loss_and_writes_json_and_png(tmp_path):
  js, png = tmp_path / "losses.json", tmp_path / "loss.png"
  result = train.main(["--steps", "8", *TINY, "--json", str(js), "--plot", str(png)])
  run = result["runs"]["reference"]
  losses = run["losses"]
  assert len(losses) == 8 and np.all(np.isfinite(losses))
  assert losses[-1] < 0.8 * losses[0], losses
  assert run["compiled_programs"] == 1  # the second step reused the first's program
  assert run["tokens_per_s"] > 0
  assert json.loads(js.read_text())["runs"]["reference"]["losses"] == losses
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layer_options_and_compare_backends_run(tmp_path):
  js, png = tmp_path / "losses.json", tmp_path / "loss.png"
  result = train.main(["--steps", "3", *TINY, "--hidden", "128", "--dp", "2", "--fp8-dispatch",
                       "--shared-ffn", "32", "--score-fn", "sigmoid", "--remat",
                       "--compare-backends", "--json", str(js), "--plot", str(png),
                       "--no-plot"])
  assert set(result["runs"]) == {"auto", "reference"}  # no kernels on CPU
  a, b = (r["losses"] for r in result["runs"].values())
  assert a[-1] < a[0]
  # Both runs took the reference here, from the same start and data. Not
  # bitwise: with jax_ep built with CUDA, backend=None traces a
  # platform_dependent whose CPU branch XLA:CPU compiles differently from
  # the plain reference (CI saw 2.9e-5 after 3 steps).
  assert result["max_relative_loss_difference"] < 1e-3
  assert js.exists() and not png.exists()


def test_swiglu_compare_fp8_trains_both_precisions_from_the_same_start(tmp_path):
  """--activation swiglu --compare-fp8: a bf16 and an FP8 run from the same
  start and data, each one program, both curves in the JSON and the plot."""
  js, png = tmp_path / "losses.json", tmp_path / "loss.png"
  result = train.main(["--steps", "4", *TINY, "--hidden", "128", "--shared-ffn", "128",
                       "--activation", "swiglu", "--compare-fp8", "--json", str(js),
                       "--plot", str(png), "--eval-every", "3", "--eval-batches", "3",
                       "--lr-schedule", "cosine", "--warmup-steps", "1"])
  runs = result["runs"]
  assert set(runs) == {"bf16", "fp8"}
  b16, f8 = runs["bf16"]["losses"], runs["fp8"]["losses"]
  assert np.all(np.isfinite(b16)) and np.all(np.isfinite(f8))
  assert b16[0] == f8[0] or abs(b16[0] - f8[0]) < 0.02 * b16[0]  # the same start
  assert b16 != f8 and f8[-1] < f8[0]
  assert all(r["compiled_programs"] == 1 for r in runs.values())
  assert result["args"]["activation"] == "swiglu"
  assert abs(result["fp8_final_loss_relative_difference"]
             - abs(f8[-1] - b16[-1]) / b16[-1]) < 1e-12
  assert result["fp8_tail_mean_relative_difference"] >= 0
  assert json.loads(js.read_text())["runs"]["fp8"]["losses"] == f8
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # The held-out eval: before the first step, every 3 steps and after the
  # last, on the same batches for both runs; the comparison is the final one.
  eb, ef = runs["bf16"]["eval"], runs["fp8"]["eval"]
  assert eb["steps"] == ef["steps"] == [0, 3, 4]
  assert all(len(b) == 3 for b in eb["batch_losses"] + ef["batch_losses"])
  assert abs(eb["losses"][0] - ef["losses"][0]) < 0.02 * eb["losses"][0]  # the same start
  assert ef["losses"][-1] < ef["losses"][0] and np.all(np.isfinite(ef["batch_losses"]))
  b, f = np.array(eb["batch_losses"][-1]), np.array(ef["batch_losses"][-1])
  assert result["fp8_eval_step"] == 4 and result["fp8_eval_batches"] == 3
  assert result["fp8_eval_final_loss"] == dict(bf16=b.mean(), fp8=f.mean())
  assert abs(result["fp8_eval_relative_gap"] - (f.mean() - b.mean()) / b.mean()) < 1e-12
  se = np.std(f - b, ddof=1) / np.sqrt(3) / b.mean()
  assert abs(result["fp8_eval_paired_se"] - se) < 1e-12 and result["fp8_eval_finite"]
  # The schedule: warm-up over one step, then cosine from --lr (3e-3) towards 0.
  np.testing.assert_allclose(runs["bf16"]["lrs"],
                             [3e-3 * 0.5 * (1 + np.cos(np.pi * max(0, k - 1) / 3))
                              for k in range(4)], rtol=1e-6)
  assert result["command"].startswith("python -m jax_ep.train --steps 4")
  assert result["date"] and result["device_kind"]


def test_learning_rate_schedules_and_eval_points():
  """auto is the constant --lr (optax gets a plain float, as before); a
  warm-up rises linearly; cosine falls from --lr towards 0. The eval runs
  before the first step, every N steps and after the last; its batches come
  from their own seed: the same every time, not the training batches."""
  args = train.parse_args(["--steps", "10", "--lr", "1e-2"])
  assert args.lr_schedule == "auto" and train._schedule(args) == 1e-2
  args = train.parse_args(["--steps", "10", "--lr", "1e-2", "--lr-schedule", "constant",
                           "--warmup-steps", "4"])
  lrs = [float(train.learning_rate(args, k, np)) for k in range(10)]
  np.testing.assert_allclose(lrs, [2.5e-3, 5e-3, 7.5e-3] + [1e-2] * 7)
  assert abs(float(train._schedule(args)(0)) - 2.5e-3) < 1e-9
  args = train.parse_args(["--steps", "10", "--lr", "1e-2", "--lr-schedule", "cosine"])
  lrs = [float(train.learning_rate(args, k, np)) for k in range(10)]
  assert lrs[0] == 1e-2 and all(a > b for a, b in zip(lrs, lrs[1:])) and 0 < lrs[-1] < 1e-3
  assert train.eval_points(10, 0) == []
  assert train.eval_points(10, 4) == [0, 4, 8, 10] and train.eval_points(8, 4) == [0, 4, 8]
  args = train.parse_args(["--eval-batches", "3", "--batch", "4"])
  perm = train.task_permutation(args.vocab, seed=args.seed)
  held = train.eval_batches(args, perm)
  again = train.eval_batches(args, perm)
  assert len(held) == 3 and all(np.array_equal(a, b) for a, b in zip(held, again))
  first_train = train.make_batch(np.random.default_rng(args.seed + 1), perm, batch=4, seq=args.seq)
  assert not any(np.array_equal(h, first_train) for h in held)
  for bad in (["--eval-every", "2", "--eval-batches", "0"], ["--warmup-steps", "-1"]):
    try:
      train.main(bad + ["--no-plot"])
    except SystemExit as e:
      assert "eval-batches" in str(e) or "warmup" in str(e)
    else:
      raise AssertionError(bad)


def test_help_shows_every_default_and_fp8_comparisons_do_not_stack():
  r = subprocess.run([sys.executable, "-m", "jax_ep.train", "--help"], cwd=ROOT,
                     capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")))
  assert r.returncode == 0, r.stderr[-2000:]
  options = r.stdout.split("options:", 1)[1]
  blocks = [" ".join(b.split()) for b in re.split(r"\n(?=  -)", options) if b.strip()]
  flags = {b.split()[0]: b for b in blocks}
  assert {"--activation", "--fp8", "--compare-fp8", "--steps"} <= set(flags)
  for flag, block in flags.items():
    assert flag == "-h," or "(default: " in block, block
  assert "(default: gelu)" in flags["--activation"]
  try:
    train.main(["--compare-fp8", "--compare-backends", "--no-plot"])
  except SystemExit as e:
    assert "pick one" in str(e)
  else:
    raise AssertionError("--compare-fp8 with --compare-backends ran")


def test_engram_run_carries_one_publication_per_step_and_compiles_once(tmp_path):
  """--engram: the step takes the last publication and returns the next
  (fetch -> loss -> grad -> update -> publish); one program for every step,
  and the loss falls. Also on a dp x ep mesh, against the reference."""
  js = tmp_path / "losses.json"
  run = train.main(["--steps", "6", *TINY, "--engram", "--json", str(js),
                    "--no-plot"])["runs"]["reference"]
  assert run["compiled_programs"] == 1
  assert run["losses"][-1] < 0.8 * run["losses"][0], run["losses"]
  result = train.main(["--steps", "2", *TINY, "--engram", "--dp", "2", "--compare-backends",
                       "--json", str(js), "--no-plot"])
  assert result["max_relative_loss_difference"] < 1e-3


def test_one_device_run_compiles_the_step_once(tmp_path):
  """On one device (a one-GPU machine, EP1) the step's outputs came back
  with single-device shardings and the second step compiled again; the step
  now returns its state placed as it takes it."""
  js = tmp_path / "one.json"
  env = dict(os.environ, JAX_NUM_CPU_DEVICES="1")
  r = subprocess.run([sys.executable, "-m", "jax_ep.train", "--cpu-devices", "1", "--steps", "3",
                      *TINY, "--batch", "4", "--engram", "--json", str(js), "--no-plot"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.loads(js.read_text())["runs"]["reference"]["compiled_programs"] == 1


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_finish_with_the_same_loss(tmp_path):
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  args = ["--steps", "3", *TINY, "--cpu-devices", "4", "--coordinator", f"127.0.0.1:{port}",
          "--num-processes", "2", "--json", str(tmp_path / "losses.json"), "--no-plot"]
  code = ("import json, sys, jax_ep.train as t; r = t.main(sys.argv[1:]); "
          "print('LOSSES', json.dumps(r['runs']['reference']['losses']))")
  procs = [subprocess.Popen([sys.executable, "-c", code, *args, "--process-id", str(i)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT) for i in range(2)]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=180)
      assert p.returncode == 0, err[-3000:]
      outs.append(out)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  losses = [json.loads(next(l for l in o.splitlines() if l.startswith("LOSSES"))[7:])
            for o in outs]
  assert losses[0] == losses[1] and losses[0][-1] < losses[0][0], losses
  # Only process 0 prints and writes.
  assert "jax_ep train:" in outs[0] and "jax_ep train:" not in outs[1]
  written = json.loads((tmp_path / "losses.json").read_text())
  assert written["processes"] == 2 and written["devices"] == 8
  # The same global computation as one process with 8 devices (this one).
  one = train.main(["--steps", "3", *TINY, "--json", str(tmp_path / "one.json"), "--no-plot"])
  np.testing.assert_allclose(one["runs"]["reference"]["losses"], losses[0], rtol=1e-5)


def test_help_shows_every_option_with_its_default(capsys):
  import pytest
  with pytest.raises(SystemExit):
    train.parse_args(["--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert text.startswith("usage: python -m jax_ep.train")
  options = text.split("options:", 1)[1]
  for flag, default in (("--steps", 30), ("--batch", 16), ("--hidden", 64), ("--lr", 0.003),
                        ("--backend", "auto"), ("--plot", "train_loss.png"),
                        ("--lr-schedule", "auto"), ("--warmup-steps", 0), ("--eval-every", 0),
                        ("--eval-batches", 8)):
    # The option's own entry (not one whose name starts the same, e.g. --lr-schedule).
    assert f"(default: {default})" in options.split(f"{flag} ", 1)[1][:200], flag
  parser_defaults = vars(train.parse_args([]))
  shown = text.count("(default: ")
  assert shown == len(parser_defaults), (shown, len(parser_defaults))
