"""
GRPO in one file: sample a group of replies per question, score them, turn the scores into group-relative
advantages, update the policy. Every term of the objective is a flag, so one script runs both nanochat's
simplified REINFORCE and DeepSeekMath's full GRPO, and everything in between.

    python grpo.py --demo                            # CPU demo: sort digits from random weights, full GRPO, minutes
    python grpo.py --demo --algo reinforce           # the same with nanochat's simplified REINFORCE
    python grpo.py                                   # GSM8K from the newest nanochat chat SFT checkpoint
    torchrun --nproc_per_node=8 grpo.py --algo grpo  # the same on 8 GPUs
    python grpo.py --compare runs/a runs/b           # side-by-side table and plot of finished runs

The objective, for a question q with replies o_1..o_G and rewards r_1..r_G, per reply token t:
    A_i       = r_i - mean(r)   (--advantage mean);  / (std(r) + eps)   (zscore);  * G / (G - 1)   (rloo)
    A_i,t     = A_i + lambda (log pi_teacher(o_t) - log pi_old(o_t))   (--distill-coef lambda, --teacher,
                                                                        --distill-divergence sampled)
    rho_t     = pi_theta(o_t) / pi_old(o_t)
    policy_t  = -min(rho_t * A_i,t, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_i,t)
                (--policy-loss cispo: -sg(clip(rho_t, ...)) * A_i,t * log pi_theta(o_t);
                 sapo: -(4 / tau) * sigmoid(tau * (rho_t - 1)) * A_i,t)
    kl_t      = k1 | k2 | k3 estimate of KL(pi_theta || pi_ref)   (or in the reward: r_i - beta sum_t k1_t)
    H_t       = entropy of pi_theta at the token's position (the full distribution)
    fkl_t     = KL(pi_teacher || pi_theta) at the token's position, over the teacher's top-k tokens and the rest
                (--distill-divergence forward, --algo distill's)
    loss      = aggregate(policy_t + beta * kl_t - c * H_t + lambda * fkl_t)  over a minibatch's reply tokens
                (nanochat | token | sequence | constant)
Top to bottom: the objective's terms, a step in the order it runs; below the banner, flags and the run's plumbing."""
import os

# A small model's ops take microseconds each, inside OpenMP parallel regions whose threads wait for one another at
# every region's end. libgomp's waiting threads spin ~300,000 rounds before they sleep: when another process shares
# the cores, a spinning thread holds a core the descheduled one needs, thousands of times a step (measured on the
# CPU demo: 60x slower steps beside three other jobs). 1,000 rounds keep most of the spin's gain alone and hand the
# core over when it is shared (docs/performance.md). Set before torch loads libgomp; a user's own setting wins.
OPENMP_SPIN = "1000"
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN)

import argparse
import copy
import errno
import fcntl
import glob
import hashlib
import importlib.util
import io
import json
import math
import pickle
import random
import re
import resource
import shutil
import signal
import sys
import textwrap
import threading
import time
import traceback
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from types import SimpleNamespace

# --help at once: importing torch takes seconds (more on a busy machine), and the flags' text needs none of it. It is
# docs/flags.txt, which tests/test_docs.py keeps the text of the parser below the banner (but for its line breaks).
FLAGS_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs", "flags.txt")
if __name__ == "__main__" and sys.argv[1:] in (["-h"], ["--help"]) and os.path.isfile(FLAGS_TEXT):
    with open(FLAGS_TEXT, encoding="utf-8") as f:
        print(f.read(), end="")
    sys.exit()

import torch
import torch.distributed as dist

from model import (CheckpointFileError, GENERATIONS, GPT, GPTConfig, HEAD_CHUNK, Muon, Tokenizer, all_reduce,
                   atomic_save, batch_rows, broadcast_weights, checkpoint_folder, checkpoint_steps, complete_steps,
                   error_summary, find_checkpoint, first_fit_decreasing, flash_varlen_takes, float32_matrices,
                   gathered_optimizer_states, in_rows, load_checkpoint, load_tensors, loadable_steps, make_optimizers,
                   master_weight_names, master_weights, noisy_projections, optimizer_version, pack_micro_batch,
                   reduce_gradients, save_checkpoint, self_check_distances, self_check_replies, shard_owners,
                   stop_signal, tokenizer_path, writing)
from tasks import (Attempts, GraderError, build, code_fingerprint, default_num_steps, episode_ends, episode_of, graded,
                   play, reply_text, task_class, task_name)
from tasks.jsonl import GRADERS


# -----------------------------------------------------------------------------
# The objective's core terms: small functions on plain tensors, each term in exactly one place. The variants
# that flags switch on (other advantages, losses and rewards, the teacher's two forms) follow the step, below.

def group_advantages(rewards, kind, eps=1e-4):
    """rewards [P, G] -> advantages [P, G], one per reply, relative to its own group ("batch": all-reduced)."""
    G = rewards.size(1)
    if kind == "none":  # the reward teaches nothing (--algo distill: the teacher does, per token, in objective)
        return torch.zeros_like(rewards)
    # An all-equal group has exactly 0 advantages under every kind, never rounding noise divided by a tiny std.
    centered = torch.where(equal_groups(rewards)[:, None], 0.0, rewards - rewards.mean(dim=1, keepdim=True))
    if kind == "mean":
        return centered
    if kind == "rloo":  # RLOO: baseline = mean of the other G - 1 rewards, i.e. G / (G - 1) * (r_i - mean(r))
        return centered * (G / (G - 1))
    if kind == "batch":  # group mean, / the std of the whole step's raw rewards over all ranks (Lite PPO; TRL's
        # scale_rewards="batch"). REINFORCE++-baseline divides by the std of the centred advantages instead.
        return centered / (std_over_ranks(rewards) + eps)
    # z-score, with the unbiased std (as the common GRPO implementations)
    return centered / (rewards.std(dim=1, keepdim=True) + eps)


def clipped_policy_loss(log_ratio, advantages, eps_low, eps_high, clip_c=None):
    """PPO-clip term. log_ratio = log pi_theta - log pi_old, per token [B, T] or per reply [B, 1] (GSPO);
    advantages [B, 1], or [B, T] with the sampled teacher's per-token term -> (loss, clipped), shaped like their
    product. With pi_old = pi_theta detached, ratio = 1 and the gradient is A * grad(log pi): REINFORCE."""
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages
    # the min takes the clipped branch (no gradient) once the ratio is past the interval the way A pushes it
    loss, was_clipped = -torch.minimum(unclipped, clipped), clipped < unclipped
    if clip_c is not None:  # dual clip (Ye et al. 2020): with A < 0 a huge ratio costs at most -C * A
        dual = (advantages < 0) & (loss > -clip_c * advantages)
        loss, was_clipped = torch.where(dual, -clip_c * advantages, loss), was_clipped | dual
    return loss, was_clipped


def kl_penalty(logprobs, ref_logprobs, estimator):
    """Per-token estimate of KL(pi_theta || pi_ref) from the sampled tokens [B, T]: its value. Its gradient is taken
    with the tokens held fixed, though they were drawn from pi_theta; in expectation over o ~ pi_theta, with
    d = log pi(o) - log pi_ref(o) and E[f(o) grad log pi(o)] = sum_o f(o) grad pi(o):
      k1 = d:                     grad d = grad log pi, whose expectation is sum_o grad pi(o) = 0; so k1 carries the
                                  score-function term d grad log pi instead (its value stays d): the gradient of
                                  KL(pi_theta || pi_ref) = sum_o grad pi(o) d(o)
      k2 = d^2 / 2:               d grad log pi, the same: the gradient of KL(pi_theta || pi_ref)
      k3 = e^-d + d - 1 (DeepSeekMath): (1 - pi_ref / pi) grad log pi, whose expectation is
                                  -sum_o pi_ref(o) grad log pi(o): the gradient of KL(pi_ref || pi_theta), the
                                  forward KL, though its value estimates the reverse one without bias
    Per position: the prefix's own probability is not differentiated (the reward placement's sum over the reply is)."""
    log_ratio = logprobs - ref_logprobs  # d = log(pi_theta / pi_ref)
    if estimator == "k1":
        return log_ratio.detach() * (1 + logprobs - logprobs.detach())  # value d, gradient d grad log pi
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    return torch.exp(-log_ratio) + log_ratio - 1  # k3: always >= 0


# The aggregation: the per-token losses of a minibatch -> one number, the same on any number of ranks and
# micro-batches. loss_denominator counts (over ranks: summed); aggregate divides each micro-batch's share. nanochat's
# aggregation is its RL loss: a question's G replies are taken in passes (nanochat's device batch, here
# --pass-size), each pass's summed loss is divided by the pass's tokens, and the passes are averaged; so its
# denominator is per row (pass_normalisers x the minibatch's replies: micro_batch_denominator).

def loss_denominator(loss_mask, kind, max_new_tokens):
    """This rank's share of the aggregation's denominator; summed over ranks before use."""
    if kind == "token":
        return loss_mask.sum()  # reply tokens (DAPO)
    if kind == "sequence":
        return (loss_mask.sum(dim=1) > 0).sum()  # replies with at least one token in the loss (GRPO paper)
    if kind == "nanochat":
        return torch.tensor(loss_mask.size(0), device=loss_mask.device)  # replies, an empty pass's too (nanochat)
    return torch.tensor(loss_mask.size(0) * max_new_tokens, device=loss_mask.device)  # a constant (Dr. GRPO)


def micro_batch_denominator(denominator, mb, kind):
    """The minibatch's denominator (loss_denominator summed over ranks) as aggregate takes it for this micro-batch:
    for nanochat's aggregation, per row, times the row's pass normaliser [R, 1]."""
    return denominator * mb["pass_normalisers"][:, None] if kind == "nanochat" else denominator


def aggregate(per_token, loss_mask, kind, denominator):
    """per_token, loss_mask [B, T] -> scalar: this micro-batch's share of its minibatch's mean. Summing the shares
    of the minibatch's micro-batches on all ranks gives its mean, whatever the micro-batch size. denominator: the
    minibatch's (a number), or [B, 1] per row under nanochat's aggregation (micro_batch_denominator)."""
    summed = per_token * loss_mask
    if kind == "sequence":  # each reply's own token mean first
        summed = summed / loss_mask.sum(dim=1, keepdim=True).clamp(min=1)
    if kind == "nanochat":
        return (summed / denominator).sum()
    return summed.sum() / denominator


def objective(logprobs, entropy, frozen, advantages, loss_mask, denominator, args, student_top=None):
    """One micro-batch's share of the loss: the terms above, as in the docstring. logprobs and entropy [B, T] carry
    the gradient; frozen holds the log-probs that do not: "old" (pi_old), "sampler" (as drawn), "ref" (None: no KL)
    and the teacher's: "teacher" (--distill-divergence sampled: its log-probs of the sampled tokens [B, T]) or
    "teacher_top" (forward: its top-k log-probs and rest, and student_top the student's at the same tokens, with the
    gradient), None without distillation; advantages [B, 1] ([B, T] with the sampled teacher's term: policy_variants).
    -> (loss, its parts for the statistics)"""
    # Masked positions (prompt, tool output, padding) enter no term: zeros in, so no inf can arise there to
    # turn the whole loss into NaN (inf * 0), and no gradient reaches them.
    keep = loss_mask > 0
    logprobs = torch.where(keep, logprobs, 0.0)
    old, sampler, ref, teacher = (torch.where(keep, frozen[k], 0.0) if frozen[k] is not None else None
                                  for k in ("old", "sampler", "ref", "teacher"))
    parts = dict(entropy=entropy.detach(), sampler_gap=old - sampler)  # logged: log pi_old - log pi_sampler [B, T]
    # GRPO: each token's ratio rho = pi_theta / pi_old, clipped, times its reply's advantage; + beta * KL to pi_ref
    log_ratio = logprobs - old  # [B, T]
    if plain_policy_term(args, teacher):
        policy, clipped = clipped_policy_loss(log_ratio, advantages, args.clip_eps, args.clip_eps_high,
                                              args.clip_ratio_c)
    else:  # the sampled teacher's advantage, GSPO's ratio a reply, CISPO's or SAPO's loss, the rollout correction
        policy, clipped, log_ratio = policy_variants(logprobs, old, log_ratio, advantages, teacher, loss_mask, args,
                                                     parts)
    loss = parts["loss_policy"] = aggregate(policy, loss_mask, args.aggregation, denominator)
    parts.update(log_ratio=log_ratio, clipped=clipped)
    if ref is not None:
        kl = kl_penalty(logprobs, ref, args.kl_estimator)
        if args.kl_placement == "reward":  # it is in the advantages already (kl_reward_penalty): logged only
            kl = kl.detach()
        parts.update(kl=kl, loss_kl=aggregate(kl, loss_mask, args.aggregation, denominator))
        if args.kl_placement == "loss":
            loss = loss + args.kl_coef * parts["loss_kl"]  # + beta * KL
    # the entropy bonus, the forward KL to a teacher
    return loss_variants(loss, entropy, student_top, frozen, keep, loss_mask, denominator, args, parts), parts


# -----------------------------------------------------------------------------
# Sampling and scoring groups

def sample_groups(model, tokenizer, task, indices, seeds, args, autocast):
    """G replies to each of these questions, scored -> indices [P], prompts, samples (P * G rows), the task's reward
    terms [P, G, terms], and [P, G] task_rewards (the terms, weighted), penalty (shaping, 0 when off) and rewards,
    their sum: the one reward advantages are built from."""
    G = args.num_samples
    conversations = [task[i] for i in indices]
    prompts = [tokenizer.render_for_completion(c) for c in conversations]
    # --sample-batch-size: questions a generate call, whole groups (their prompt is prefilled once). Each question's
    # noise comes from its own seed, so how they are split changes nothing but memory.
    per_call = max(1, (args.sample_batch_size or len(prompts) * G) // G)
    with autocast:
        chunks = [play(task, model, tokenizer, prompts[i:i + per_call], conversations[i:i + per_call], G,
                       args.max_new_tokens, args, temperature=args.temperature, top_k=args.top_k,
                       seed=seeds[i:i + per_call], decode=args.decode) for i in range(0, len(prompts), per_call)]
    samples = {k: torch.cat([chunk[k] for chunk in chunks]) for k in chunks[0]}
    # An episode of several turns is graded once, as a whole (graded: the conversation with its turns, the last reply)
    terms = torch.tensor([[parts[name] for name in task.reward_terms] for parts in (
        task.reward_parts(*graded(task, tokenizer, conversations[row // G], samples, row))
        for row in range(len(prompts) * G))]).view(len(prompts), G, -1)  # [P, G, terms]
    task_rewards = sum(weight * terms[..., task.reward_terms.index(name)]  # [P, G]
                       for name, weight in args.reward_weights.items())
    penalty = torch.zeros_like(task_rewards)
    if args.overlong_buffer:  # DAPO: cut-off and nearly cut-off replies lose reward, so length is learned too
        # the tokens the policy sampled: not an environment's turns or a tool's output, which it did not write
        penalty = overlong_penalty(samples["mask"].sum(dim=1), args.max_new_tokens, args.overlong_buffer).view(-1, G)
    # [P, G, weighted terms + 1]: the terms --reward-weights combines, then the shaping penalty (weight 1)
    reward_parts = torch.stack([terms[..., task.reward_terms.index(name)] for name in args.reward_weights]
                               + [penalty], dim=-1)
    return dict(indices=torch.tensor(indices), prompts=prompts, samples=samples, terms=terms,
                task_rewards=task_rewards, penalty=penalty, rewards=task_rewards + penalty, reward_parts=reward_parts)


def equal_groups(rewards, reward_parts=None):
    """rewards [P, G] -> [P] bool: the groups whose replies all got the same reward. Their advantages are 0. With
    reward_parts [P, G, terms] (--reward-combination normalize-then-sum, whose advantages come from each term): the
    groups in which every term is equal; an equal sum of unequal terms still teaches there."""
    if reward_parts is not None:
        return (reward_parts.amax(dim=1) == reward_parts.amin(dim=1)).all(dim=-1)
    return rewards.max(dim=1).values == rewards.min(dim=1).values


def signal_less_groups(groups, args):
    """[P] bool: the sampled groups whose advantages are 0 (equal_groups, by the run's reward combination)."""
    return equal_groups(groups["rewards"], groups["reward_parts"] if args.reward_combination != "sum" else None)


# -----------------------------------------------------------------------------
# One step of training: the batch, the frozen log-probs, the update

def make_batch(prompts, samples, rewards, args, static=None, reward_parts=None):
    """Sampled groups -> the training batch. Each row is prompt + reply, right-padded (the causal mask makes
    padding on the right harmless). rewards [P, G]; every tensor below has one row per reply, N = P * G.
    The loss mask keeps the tokens the policy sampled: no prompt, no forced tool output, no padding. Built on the
    host, with the update's plan, so the update never waits for the device: minibatch j holds the rows whose global
    index (over the ranks) is j mod --num-minibatches (one optimizer step each); a micro-batch is one forward and
    backward pass over some of one minibatch's rows, --device-batch-size of them or packed into one sequence (--pack),
    their gradients summed; minibatch_totals [num_minibatches, 2]: this rank's loss denominator and loss tokens of
    each (plan_micro_batches, below the banner).
    static: (rows, tokens a row) that packed passes are padded to, for a compiled forward (None: as they come).
    reward_parts [P, G, terms + 1] (sample_groups): for --reward-combination normalize-then-sum. Every rank builds
    its batch: the advantages may all-reduce (--advantage batch, normalize-then-sum)."""
    G = args.num_samples
    lengths = samples["lengths"].tolist()
    widths = [len(prompts[row // G]) + lengths[row] - 1 for row in range(len(lengths))]  # input tokens per row
    T = max(widths)
    tokens, mask, logprobs = (samples[k].tolist() for k in ("tokens", "mask", "logprobs"))  # one copy each, not per row
    rows = dict(input_ids=[], target_ids=[], loss_mask=[], sampler_logprobs=[])  # sampler: log pi_sampler, as drawn
    for row, length in enumerate(lengths):
        prompt = prompts[row // G]
        sequence = prompt + tokens[row][:length]
        before, after = [0] * (len(prompt) - 1), [0] * (T + 1 - len(sequence))  # prompt positions, right padding
        rows["input_ids"].append(sequence[:-1] + after)
        rows["target_ids"].append(sequence[1:] + after)
        rows["loss_mask"].append(before + mask[row][:length] + after)
        rows["sampler_logprobs"].append(before + logprobs[row][:length] + after)
    input_ids, target_ids = torch.tensor(rows["input_ids"]), torch.tensor(rows["target_ids"])  # [N, T]
    sampled_mask = torch.tensor(rows["loss_mask"], dtype=torch.float32)  # every token the policy sampled
    sampler_logprobs = torch.tensor(rows["sampler_logprobs"], dtype=torch.float32)
    equal = equal_groups(rewards, reward_parts if args.reward_combination != "sum" else None)  # [P]
    loss_mask = sampled_mask.clone()
    if args.drop_equal_groups:  # they carry no signal (A = 0) but would still count in the normaliser
        loss_mask *= (~equal).repeat_interleave(G)[:, None]
    if args.mask_truncated:  # overlong filtering: a cut-off reply is not judged on its missing ending
        loss_mask *= (~samples["truncated"])[:, None]
    if args.reward_combination == "sum":
        advantages = group_advantages(rewards, args.advantage).flatten()  # [N]
    else:
        advantages = term_advantages(reward_parts, list(args.reward_weights.values()) + [1.0]).flatten()
    batch = dict(input_ids=input_ids, target_ids=target_ids, loss_mask=loss_mask, sampled_mask=sampled_mask,
                 advantages=advantages, sampler_logprobs=sampler_logprobs, rewards=rewards,
                 equal_groups=equal, widths=torch.tensor(widths))  # equal_groups [P], logged; widths [N]
    if args.aggregation == "nanochat":
        batch["pass_normalisers"] = pass_normalisers(loss_mask, G, args.pass_size)  # [N]
    batch["micro_batches"], batch["minibatch_totals"], batch["row_minibatch"] = plan_micro_batches(batch, args, static)
    return batch


def logprobs_of(net, mb, args, with_entropy=False, top_ids=None):
    """A micro-batch's log-probs (and entropies; and with top_ids, a teacher's top-k ids in the pass's layout, the
    log-probs of those tokens and of the rest) in its rows' layout, [R, width, ...]: a packed pass runs as one
    sequence, each row's tokens taken back out of it. Entropies carry a gradient under the bonus, else are logged."""
    out = net.token_logprobs(mb["input_ids"], mb["target_ids"], args.temperature, with_entropy=with_entropy,
                             positions=mb["positions"], pack=mb.get("pack"), entropy_grad=args.entropy_coef > 0,
                             top_ids=top_ids)
    return tuple(in_rows(t, mb) for t in out) if isinstance(out, tuple) else in_rows(out, mb)


@torch.no_grad()
def frozen_logprobs(net, micro_batches, args, autocast):
    """Log-probs of the micro-batches under a net that does not train (pi_old, pi_ref): one [R, width] each."""
    with autocast:
        return [logprobs_of(net, mb, args) for mb in micro_batches]


def policy_update(model, optimizers, batch, args, autocast, ref_model=None, owners=None, teacher=None):
    """ppo_epochs passes over the batch, num_minibatches optimizer steps per pass -> (stats, logprob seconds).
    owners: a sharded optimizer's rank per weight (shard_owners; None: all step all); teacher: --distill-coef's net."""
    micro_batches = batch["micro_batches"]
    start = time.time()
    old_logprobs, ref_logprobs, teacher_logprobs = frozen_terms(model, batch, args, autocast, ref_model, teacher)
    if ref_model is not None and args.kl_placement == "reward":  # the KL as a reward: the advantages made anew
        batch["advantages"] = kl_reward_advantages(batch, old_logprobs, ref_logprobs, args)
    time_logprobs = time.time() - start
    advantages = batch["advantages"][:, None]  # [N, 1]
    # each minibatch's loss denominator, policy tokens, non-zero-advantage tokens: summed over ranks, one device read
    totals = all_reduce(torch.cat([batch["minibatch_totals"].to(advantages.device),
                                   signal_tokens(batch, args)], dim=1)).tolist()
    stats = update_stats(advantages.device)
    stepped = False  # until the batch's first optimizer step pi_old is pi_theta: rho = 1 exactly, nothing clips
    model.train()
    for _ in range(args.ppo_epochs):
        for j, (denominator, tokens, tokens_with_advantage) in enumerate(totals):
            if tokens == 0:  # e.g. every group dropped: a step on zero gradients would still move weights (momentum)
                stats["empty_updates"] += 1
                continue
            # No policy signal (every advantage 0, no entropy bonus, no teacher): the step a KL-free run takes, on a
            # zero gradient (nanochat's). The KL alone would be a gradient of rounding-level size, and Muon and Adam,
            # which normalise a step's scale, would turn it into a full step away from the reference
            # (docs/algorithm.md). Its forward still runs, without a graph: pi_old and the logged terms.
            learns = tokens_with_advantage > 0 or args.entropy_coef > 0 or teacher is not None
            stats["no_signal_updates"] += not learns
            minibatch_loss = torch.zeros((), dtype=torch.float64, device=advantages.device)
            for i in (i for i, mb in enumerate(micro_batches) if mb["minibatch"] == j):
                mb = micro_batches[i]
                # Where pi_old comes from: it is the policy before the batch's first optimizer step. A pass before
                # that step computes it itself: its own log-probs, detached (None here; rho = 1 exactly, nothing
                # clips), kept below for the later epochs. A pass after it reads them (or, for a minibatch first
                # reached after a step, the forward frozen_terms ran before the first step).
                old = old_logprobs[i] if stepped else None
                with autocast, torch.set_grad_enabled(learns):
                    loss, parts, logprobs = micro_batch_loss(
                        model, mb, old, ref_logprobs[i], teacher_logprobs[i], advantages[mb["rows"]],
                        micro_batch_denominator(denominator, mb, args.aggregation), args)
                if not stepped:
                    old_logprobs[i] = logprobs
                if learns:
                    loss.backward()
                minibatch_loss += loss.detach()
                add_micro_batch_stats(stats, loss, parts, mb["loss_mask"], stepped)
            stepped |= minibatch_step(model, optimizers, stats, minibatch_loss, learns, args, owners)
    return finish_update_stats(stats, args, with_kl=ref_model is not None, with_teacher=teacher is not None), \
        time_logprobs


def micro_batch_loss(model, mb, old_logprobs, ref_logprobs, teacher_logprobs, advantages, denominator, args):
    """One forward pass of the update: the micro-batch's log-probs under the policy, and its share of the loss
    (objective). old_logprobs None: this pass is pi_old's own (policy_update), its log-probs detached (rho = 1).
    -> (loss, parts, log-probs [R, width], detached). The start-up self-check runs its paths through this too."""
    forward = isinstance(teacher_logprobs, dict)  # --distill-divergence forward: the student at the teacher's top-k
    logprobs, entropy, *student_top = logprobs_of(model, mb, args, with_entropy=True,
                                                  top_ids=teacher_logprobs["ids"] if forward else None)
    frozen = dict(old=logprobs.detach() if old_logprobs is None else old_logprobs, sampler=mb["sampler_logprobs"],
                  ref=ref_logprobs, teacher=None if forward else teacher_logprobs,
                  teacher_top=teacher_logprobs["logprobs"] if forward else None)
    loss, parts = objective(logprobs, entropy, frozen, advantages, mb["loss_mask"], denominator, args,
                            student_top or None)
    return loss, parts, logprobs.detach()


def frozen_terms(model, batch, args, autocast, ref_model=None, teacher=None):
    """The update's frozen log-probs, one [R, width] per micro-batch (None where not taken): pi_old where a pass
    needs it before its own forward, pi_ref and the teacher's -> (old, ref, teacher)."""
    micro_batches = batch["micro_batches"]
    # pi_old (see policy_update): only minibatches first reached after a step (the 2nd.. of the first epoch) need a
    # forward of their own, now; all of them when the KL is a reward term, which needs pi_old before the advantages.
    kl_in_reward = ref_model is not None and args.kl_placement == "reward"
    old_logprobs, ref_logprobs, teacher_logprobs = ([None] * len(micro_batches) for _ in range(3))
    later = [i for i, mb in enumerate(micro_batches) if kl_in_reward or mb["minibatch"] > 0]
    for i, logprobs in zip(later, frozen_logprobs(model, [micro_batches[i] for i in later], args, autocast)):
        old_logprobs[i] = logprobs
    device = batch["advantages"].device
    if ref_model is not None:  # a frozen copy, or with LoRA the policy itself with its adapters off (no-op otherwise)
        with ref_model.lora_disabled(), on_device(ref_model, device, args.ref_offload):
            ref_logprobs = frozen_logprobs(ref_model, micro_batches, args, autocast)
    if teacher is not None:  # on the same passes
        with on_device(teacher, device, args.teacher_offload):
            teacher_logprobs = teacher_terms(teacher, micro_batches, args, autocast)
    return old_logprobs, ref_logprobs, teacher_logprobs


def teacher_terms(teacher, micro_batches, args, autocast):
    """The teacher's frozen term of each micro-batch: its top-k log-probs and the rest's (--distill-divergence
    forward: teacher_top_logprobs), or its log-probs of the sampled tokens [R, width] (sampled)."""
    if args.distill_divergence == "forward":
        with autocast:
            return [teacher_top_logprobs(teacher, mb, args) for mb in micro_batches]
    return frozen_logprobs(teacher, micro_batches, args, autocast)


def minibatch_step(model, optimizers, stats, minibatch_loss, learns, args, owners):
    """A minibatch's optimizer step, after its backward passes: on a zero gradient without policy signal, on the
    gradients summed over ranks (each rank's loss is its share of the global mean), never on a non-finite loss.
    -> whether the weights stepped (from then on pi_theta differs from pi_old: ratios can clip)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not learns:
        for p in trainable:
            p.grad = torch.zeros_like(p)
    reduce_gradients(trainable, owners)
    stepped = bool(torch.isfinite(all_reduce(minibatch_loss.clone())))
    if stepped:
        optimizer_step(model, optimizers, stats, args.grad_clip, owners)
    stats["skipped_updates"] += not stepped  # a non-finite loss: the weights stay as they were
    model.zero_grad(set_to_none=True)
    return stepped


def signal_tokens(batch, args):
    """-> [num_minibatches, 1]: this rank's loss tokens whose reply has a non-zero advantage, per minibatch."""
    advantages = batch["advantages"]
    per_row = batch["loss_mask"].sum(dim=1) * (advantages != 0)  # [N]
    return torch.zeros(args.num_minibatches, 1, dtype=torch.float64, device=advantages.device).index_add_(
        0, batch["row_minibatch"], per_row.double()[:, None])


def train(args, run):
    """The step loop: sample -> score -> advantages -> batch -> update -> end of step. `run` holds what the
    plumbing below the banner set up: the model, its reference and optimizers, the tasks, device and run folder."""
    model, ref_model, tokenizer, task = run.model, run.ref_model, run.tokenizer, run.train_task
    for step in range(run.start_step, args.num_steps):
        step_start = time.time()
        lr_multiplier = set_learning_rates(run.optimizers, step, args)
        if ref_model is not None and args.ref_reset_every and step > 0 and step % args.ref_reset_every == 0:
            reset_reference(model, ref_model, run.optimizers, step, args)

        # Sample a group of G replies for each of this rank's questions, and score them.
        model.eval()
        indices = prompt_indices(step, run.rank, run.world_size, args, len(task))
        seeds = [random.Random(f"{args.seed}-{step}-{i}").getrandbits(62) for i in indices]
        groups = sample_groups(model, tokenizer, task, indices, seeds, args, run.autocast)
        rounds = 1
        if args.dynamic_sampling:
            groups, rounds = dynamic_sampling(groups, model, tokenizer, task, step, run.rank, args, run.autocast)
        time_sample = time.time() - step_start

        # Build the batch with group-relative advantages; update the policy.
        batch = to_device(make_batch(groups["prompts"], groups["samples"], groups["rewards"], args, run.static_pack,
                                     groups["reward_parts"]), run.device)
        update_start = time.time()
        stats, time_logprobs = policy_update(model, run.optimizers, batch, args, run.autocast, ref_model, run.owners,
                                             run.teacher)

        # Log, check, evaluate, save.
        times = dict(time_sample=time_sample, time_logprobs=time_logprobs,
                     time_update=time.time() - update_start - time_logprobs)
        end_of_step(args, run, step, groups, batch, stats, times, rounds, lr_multiplier, step_start)


# -----------------------------------------------------------------------------
# The variants: each a flag's change to a term above (those that all-reduce, so every rank must call, say so)

def plain_policy_term(args, teacher):
    """Whether the policy term is GRPO's own: PPO's clip per token, on the sampler's tokens as pi_old's."""
    return (teacher is None and args.ratio_level == "token" and args.policy_loss == "clip"
            and args.rollout_correction == "off")


def policy_variants(logprobs, old, log_ratio, advantages, teacher, loss_mask, args, parts):
    """objective's policy term under the flags that change it -> (per-token loss, clipped, the log-ratio logged)."""
    if teacher is not None:  # the sampled teacher: a per-token advantage, [B, 1] -> [B, T]
        advantages, parts["teacher_kl"] = sampled_teacher_advantages(advantages, old, teacher, args.distill_coef)
    if args.ratio_level == "sequence":  # GSPO: the reply is clipped as a whole
        log_ratio = sequence_log_ratio(log_ratio, loss_mask)  # [B, 1]
    if args.policy_loss == "cispo":  # clip the weight
        policy, clipped = cispo_policy_loss(logprobs, log_ratio, advantages, args.clip_eps, args.clip_eps_high)
    elif args.policy_loss == "sapo":  # a soft gate
        policy, clipped = sapo_policy_loss(log_ratio, advantages, args.sapo_tau_pos, args.sapo_tau_neg)
    else:  # clip the ratio
        policy, clipped = clipped_policy_loss(log_ratio, advantages, args.clip_eps, args.clip_eps_high,
                                              args.clip_ratio_c)
    if args.rollout_correction != "off":  # the tokens came from pi_sampler (top-k, bf16), not from pi_old
        # GSPO's loss is per reply: one weight per reply, from the mean gap as its ratio is the mean log-ratio
        gap = parts["sampler_gap"]
        gap = sequence_log_ratio(gap, loss_mask) if args.ratio_level == "sequence" else gap
        policy = policy * rollout_weights(gap, args.rollout_correction, args.rollout_correction_cap)
    return policy, clipped, log_ratio


def loss_variants(loss, entropy, student_top, frozen, keep, loss_mask, denominator, args, parts):
    """objective's loss with the terms beside GRPO's: the entropy bonus, the forward KL to a teacher."""
    if args.entropy_coef:  # - c * entropy: a bonus that holds off the collapse onto one reply (the entropy is finite)
        loss = loss - args.entropy_coef * aggregate(entropy, loss_mask, args.aggregation, denominator)
    if student_top is not None:  # + lambda * KL(pi_teacher || pi_theta), the teacher's distribution at each position
        teacher_kl = forward_kl(student_top, frozen["teacher_top"]) * keep  # [B, T]
        parts["teacher_kl"] = teacher_kl.detach()
        loss = loss + args.distill_coef * aggregate(teacher_kl, loss_mask, args.aggregation, denominator)
    return loss


def term_advantages(reward_parts, weights, eps=1e-4):
    """--reward-combination normalize-then-sum (GDPO, arXiv 2601.05242): each reward term z-scored within its group
    (whatever --advantage says: centring alone would keep the terms' proportions, and a 0/1 term next to a 0/10 one
    would still be drowned), weighted and summed, then divided by the std of that sum over the step's replies on all
    ranks (an all-reduce). reward_parts [P, G, K] -> [P, G]."""
    summed = sum(w * group_advantages(reward_parts[..., k], "zscore") for k, w in enumerate(weights))
    return summed / (std_over_ranks(summed) + eps)


def std_over_ranks(values):
    """The unbiased std of these values over the step's replies on all ranks (one all-reduce)."""
    count, total, squares = all_reduce(torch.stack([torch.tensor(values.numel(), dtype=torch.float64,
                                                                 device=values.device),
                                                    values.double().sum(), values.double().square().sum()]))
    return ((squares - total ** 2 / count) / (count - 1)).clamp(min=0).sqrt().float()


def sequence_log_ratio(log_ratio, loss_mask):
    """GSPO: one log-ratio per reply, the mean of its policy tokens' log-ratios. [B, T] -> [B, 1]. Its exponential
    is the length-normalised ratio of the whole reply's likelihood; its gradient reaches every token of the reply."""
    return (log_ratio * loss_mask).sum(dim=1, keepdim=True) / loss_mask.sum(dim=1, keepdim=True).clamp(min=1)


def cispo_policy_loss(logprobs, log_ratio, advantages, eps_low, eps_high):
    """CISPO (MiniMax-M1, arXiv 2506.13585, its eq. 4): the importance weight rho is clipped and detached, and
    every token keeps the gradient A * weight * grad(log pi), however far its ratio has moved (PPO's clip drops the
    token instead). logprobs, log_ratio [B, T]; advantages [B, 1] or [B, T] -> (loss, clipped). With rho = 1
    (pi_old = pi_theta): -A log pi, whose gradient is plain REINFORCE's."""
    ratio = torch.exp(log_ratio.detach())
    weight = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    return -weight * advantages * logprobs, weight != ratio


def sapo_policy_loss(log_ratio, advantages, tau_pos, tau_neg):
    """SAPO (Qwen, arXiv 2511.20347): a smooth gate in place of the clip, -(4 / tau) sigmoid(tau (rho - 1)) A, with
    tau_neg (> tau_pos) where A < 0, whose gate decays faster. Its gradient is A * 4 sigmoid'(tau (rho - 1)) * rho *
    grad(log pi): at rho = 1 the policy gradient, falling off as rho leaves 1. -> (loss, clipped: all False)."""
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1)) * (4 / tau)
    return -gate * advantages, torch.zeros_like(log_ratio, dtype=torch.bool)


def rollout_weights(sampler_gap, kind, cap):
    """Weights of the policy term from log(pi_old / pi_sampler), per token [B, T] or per reply [B, 1], detached.
    tis (truncated importance sampling): the ratio, at most cap; mask: 1 where it is in [1 / cap, cap], else 0."""
    ratio = torch.exp(sampler_gap)
    return ratio.clamp(max=cap) if kind == "tis" else ((ratio >= 1 / cap) & (ratio <= cap)).float()


@torch.no_grad()
def kl_reward_penalty(old_logprobs, ref_logprobs, sampled_mask, kl_coef):
    """--kl-placement reward: beta x each reply's summed k1, log pi_old - log pi_ref over every token the policy
    sampled ([N, T] -> [N]; also in a reply that --mask-truncated or --drop-equal-groups leave out of the loss: it
    still counts in its group's mean and std), to subtract from its reward before the advantages (detached: a
    reward, not a loss term). Through the policy term its expected gradient is beta x that of KL(pi_theta ||
    pi_ref) of whole replies, the unbiased placement ("A Comedy of Estimators", 2025); group normalisation sees it
    like any reward, so an all-equal group's advantages are the spread of its KLs: beta-sized under mean and rloo,
    / the step's std under batch, unit-sized under zscore (docs/algorithm.md)."""
    return kl_coef * ((old_logprobs - ref_logprobs) * sampled_mask).sum(dim=1)


def kl_reward_advantages(batch, old_logprobs, ref_logprobs, args):
    """--kl-placement reward: the group-relative advantages of r_i - beta sum_t k1_t (kl_reward_penalty) -> [N]."""
    penalty = torch.zeros_like(batch["advantages"], dtype=ref_logprobs[0].dtype)  # [N]
    for mb, old, ref in zip(batch["micro_batches"], old_logprobs, ref_logprobs):
        penalty[mb["rows"]] = kl_reward_penalty(old, ref, mb["sampled_mask"], args.kl_coef)
    rewards = batch["rewards"].to(penalty.device) - penalty.view_as(batch["rewards"])
    return group_advantages(rewards, args.advantage).flatten()


def pass_normalisers(loss_mask, G, pass_size):
    """nanochat's aggregation: loss_mask [N, T] -> [N]: per row, its pass's tokens x the question's passes / G: each
    reply's sum / this, averaged over the replies, is nanochat's loss (pass_size dividing G: the pass's mean length)."""
    N = loss_mask.size(0)
    passes = -(-G // pass_size)  # per question
    row = torch.arange(N, device=loss_mask.device)
    pass_of_row = row // G * passes + row % G // pass_size  # [N]
    tokens = torch.zeros(N // G * passes, device=loss_mask.device).index_add_(0, pass_of_row, loss_mask.sum(dim=1))
    return tokens.clamp(min=1)[pass_of_row] * (passes / G)  # an empty pass: nanochat's max(1, tokens), its loss is 0


def sampled_teacher_advantages(advantages, old, teacher, coef):
    """--distill-divergence sampled, the teacher's per-token advantage: every token the student sampled gains coef *
    (log pi_teacher(o_t) - log pi_old(o_t)), frozen: minus the one-sample estimate of the reverse KL(pi_theta ||
    pi_teacher) at that position, whose policy gradient (discount 0: no later token's term) is exactly the gradient of
    that KL (docs/algorithm.md). Added to the reply's group advantage, so reward and teacher can teach together.
    advantages [B, 1]; old, teacher [B, T] -> (advantages [B, T], the sampled reverse KL [B, T])."""
    teacher_kl = old - teacher
    return advantages - coef * teacher_kl, teacher_kl


def forward_kl(student, teacher):
    """KL(pi_teacher || pi_theta) at each position, over the teacher's top-k tokens and one bucket for the mass of
    all the others (GKD's forward KL, on the student's own prefixes; exact when k covers the vocabulary):
        sum_v p_T(v) (log p_T(v) - log p_theta(v)) + p_T(rest) (log p_T(rest) - log p_theta(rest)).
    Its gradient, -sum_v p_T(v) grad log p_theta(v) (and the bucket's), pulls up every token the teacher likes, in
    proportion to the teacher's probability: also those the student does not yet sample (the sampled reverse KL's
    pull on a token is proportional to the student's own probability of it). student, teacher: (log-probs at the
    teacher's top-k [B, T, k], log-mass of the rest [B, T] or None) -> [B, T]."""
    (student_top, student_rest), (teacher_top, teacher_rest) = student, teacher
    p = teacher_top.exp()
    kl = (torch.xlogy(p, p) - p * student_top).sum(dim=-1)  # xlogy: 0 log 0 = 0
    if teacher_rest is not None:
        p_rest = teacher_rest.exp()
        kl = kl + torch.xlogy(p_rest, p_rest) - p_rest * student_rest
    return kl


def overlong_penalty(lengths, max_len, buffer):
    """DAPO's soft overlong penalty, added to the reward: 0 up to max_len - buffer tokens, then falling linearly
    to -1 at max_len (a reply is cut there, so -1 is also what longer ones would get). lengths [N] -> [N]."""
    return ((max_len - buffer - lengths.float()) / buffer).clamp(min=-1.0, max=0.0)


def dynamic_sampling(first, model, tokenizer, task, step, rank, args, autocast):
    """DAPO's dynamic sampling: keep only groups whose rewards differ (the others have zero advantages), drawing
    more questions until there are as many as the step's share, for at most --max-sampling-rounds rounds in all;
    if still short, equal groups fill the batch up. A round's questions and noise are pure functions of (seed,
    step, rank, round), so a resumed run draws the same ones. -> (the groups, as sample_groups returns them, with
    "drawn": the reward terms, task rewards, rewards and reward parts [R * P, ...] of every group sampled, for the
    policy's own reward in the log, and the tokens sampled in each of their replies; rounds)"""
    wanted, G = len(first["prompts"]), args.num_samples
    parts, differing = [first], [~signal_less_groups(first, args)]  # differing: [P] bool per round
    while len(parts) < args.max_sampling_rounds and sum(int(d.sum()) for d in differing) < wanted:
        draw = random.Random(f"{args.seed}-{step}-{rank}-round{len(parts)}")
        indices = draw.sample(range(len(task)), min(wanted, len(task)))
        seeds = [draw.getrandbits(62) for _ in indices]
        parts.append(sample_groups(model, tokenizer, task, indices, seeds, args, autocast))
        differing.append(~signal_less_groups(parts[-1], args))
    kept = [(p, g) for want in (True, False) for p, d in enumerate(differing)  # differing groups first
            for g in range(len(d)) if bool(d[g]) == want][:wanted]
    groups = {k: torch.stack([parts[p][k][g] for p, g in kept]) for k in first if k not in ("prompts", "samples")}
    samples = {k: torch.cat([parts[p]["samples"][k][g * G:(g + 1) * G] for p, g in kept]) for k in first["samples"]}
    drawn = {k: torch.cat([part[k] for part in parts]) for k in ("terms", "task_rewards", "rewards", "reward_parts")}
    drawn["sampled"] = torch.cat([part["samples"]["mask"].sum(dim=1) for part in parts])  # [R * P * G]: every reply
    return dict(groups, prompts=[parts[p]["prompts"][g] for p, g in kept], samples=samples, drawn=drawn), len(parts)


def reset_reference(model, ref_model, optimizers, step, args):
    """DeepSeekMath's iterative variant: the reference moves to the current policy every --ref-reset-every steps."""
    if args.lora_rank:  # the reference is the base: fold the adapters into it and restart them, Adam's moments too
        model.merge_lora(seed=args.seed + step)
        optimizers[0].state.clear()
    else:
        ref_model.load_state_dict(model.state_dict())


# =============================================================================
# The run's plumbing, in the order it is called: what a step calls, then main and the run's set-up, the flags, the
# run folder and --resume, evaluation and --ask, --compare. Nothing below needs to be read to follow the algorithm.
# =============================================================================


# -----------------------------------------------------------------------------
# The questions a step takes (a pure function of (step, rank): a resumed run picks up where it stopped), and the
# update's micro-batches: which rows share a pass, and their layout as one sequence

EPOCH_ORDERS = {}  # (num_examples, seed, prompts_per_step) -> (the latest epoch computed, its order)


def epoch_order(num_examples, seed, epoch, prompts_per_step):
    """Epoch `epoch` (>= 1)'s order of the questions: a permutation drawn from (seed, epoch), but those a step that
    straddles the previous epoch holds come later (no group twice). Computed forward from epoch 1, the latest kept."""
    key, start = (num_examples, seed, prompts_per_step), (0, range(num_examples))  # epoch 0: the task's own order
    done, order = EPOCH_ORDERS.get(key, start)
    if done > epoch:
        done, order = start
    while done < epoch:
        done += 1
        straddled = done * num_examples % prompts_per_step  # questions of epoch done - 1 in the straddling step
        held = set(order[num_examples - straddled:])  # none when no step straddles
        shuffled = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 1000 + done)).tolist()
        taken = set([q for q in shuffled if q not in held][:prompts_per_step - straddled])  # the rest of that step
        order = sorted(shuffled, key=lambda q: q not in taken)  # those first; both parts in the shuffled order
    EPOCH_ORDERS[key] = (done, order)
    return order


def prompt_indices(step, rank, world_size, args, num_examples):
    """The task indices this rank trains on at this step: epoch 0 in the task's own order, later ones epoch_order's."""
    per_rank = args.prompts_per_step // world_size
    first = step * args.prompts_per_step + rank * per_rank
    return [i if epoch == 0 else epoch_order(num_examples, args.seed, epoch, args.prompts_per_step)[i]
            for epoch, i in (divmod(g, num_examples) for g in range(first, first + per_rank))]


def to_device(batch, device):
    """The batch's tensors, its micro-batches' too, on the device (in one go, before the update)."""
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return [to_device(v, device) for v in batch] if isinstance(batch, list) else batch


def plan_micro_batches(batch, args, static=None):
    """The update's micro-batches -> (a list of dicts of tensors, each with its minibatch's number; this rank's
    [num_minibatches, 2] loss denominator and policy tokens per minibatch; each row's minibatch [N]). Minibatch j:
    the replies whose global row is j modulo num_minibatches, so any number of ranks takes the same steps. --pack
    fills passes of --tokens-per-pass tokens first-fit, longest first; --device-batch-size: runs of that many rows.
    A pass holds the flat positions its log-probs are needed at: no forward pass asks the device (a sync)."""
    widths = batch["widths"].tolist()
    N, G = len(widths), args.num_samples
    rank = dist.get_rank() if dist.is_initialized() else 0
    needed = "sampled_mask" if args.kl_coef and args.kl_placement == "reward" else "loss_mask"
    row_minibatch = [(rank * N + r) % args.num_minibatches for r in range(N)]
    micro_batches, totals = [], []
    for j in range(args.num_minibatches):
        rows = [r for r in range(N) if row_minibatch[r] == j]
        mask = batch["loss_mask"][rows]
        totals.append([float(loss_denominator(mask, args.aggregation, args.max_new_tokens)), float(mask.sum())])
        if args.pack and args.device_batch_size is None:
            passes = first_fit_decreasing(rows, widths, args.tokens_per_pass)
        else:  # passes that do not depend on the number of ranks (when the size divides a rank's rows)
            rows.sort(key=lambda r: (r // G, -widths[r]))
            passes = [rows[i:i + args.device_batch_size] for i in range(0, len(rows), args.device_batch_size)]
        for chunk in passes:
            width = max(widths[r] for r in chunk)
            mb = dict({k: batch[k][chunk, :width] for k in ("input_ids", "target_ids", "loss_mask", "sampled_mask",
                                                            "sampler_logprobs")}, minibatch=j, rows=torch.tensor(chunk))
            if "pass_normalisers" in batch:  # nanochat's aggregation: each row's (micro_batch_denominator)
                mb["pass_normalisers"] = batch["pass_normalisers"][chunk]
            if args.pack:  # the masks stay in the rows' layout
                mb.update(pack_micro_batch(mb, [widths[r] for r in chunk], args.tokens_per_pass, static))
                mb["positions"] = mb["row_positions"][mb[needed] > 0]  # [K], flat in the packed sequence
            else:
                mb["positions"] = mb[needed].flatten().nonzero().squeeze(1)  # [K], flat in [R * width]
            micro_batches.append(mb)
    return micro_batches, torch.tensor(totals, dtype=torch.float64), torch.tensor(row_minibatch)


@torch.no_grad()
def teacher_top_logprobs(teacher, mb, args):
    """--distill-divergence forward: the teacher's --distill-top-k tokens at the micro-batch's loss positions ->
    dict(ids in the pass's layout, for the student's head; their log-probs and the rest's, in the rows' layout)."""
    ids, top, rest = teacher.top_logprobs(mb["input_ids"], args.distill_top_k, args.temperature,
                                          positions=mb["positions"], pack=mb.get("pack"))
    return {"ids": ids, "logprobs": (in_rows(top, mb), in_rows(rest, mb))}


# -----------------------------------------------------------------------------
# The optimizer step and the update's statistics (summed on the device, read once at its end), the learning rates

def update_stats(device):
    zero = torch.zeros((), dtype=torch.float64, device=device)
    sums = {k: zero.clone() for k in ("loss", "loss_policy", "loss_kl", "clipped_low", "clipped_high", "clip_tokens",
                                      "tokens", "kl", "entropy", "sampler_gap", "teacher_kl")}
    # optimizer-step sums are not in `sums`: every rank holds the same weights and gradients, nothing to reduce
    return dict(sums=sums, ratio_min=zero + float("inf"), ratio_max=zero - float("inf"), steps=0,
                grad_norm=zero.clone(), update_ratio=zero.clone(), weight_norm_factor=zero + 1, skipped_updates=0,
                empty_updates=0, no_signal_updates=0, weights_finite=torch.ones((), dtype=torch.bool, device=device))


@torch.no_grad()
def optimizer_step(model, optimizers, stats, grad_clip, owners=None):
    """Clip (when asked) and step every optimizer, measuring the gradient's norm (before clipping), the update/weight
    ratio and the factor by which the weights' norm changed. One weight (Muon: one stack) steps at a time, so that
    the measurement copies one tensor, never an optimizer's share. Sharded (owners): a rank steps its own weights."""
    params = [p for p in model.parameters() if p.grad is not None]
    squares = torch.stack(torch._foreach_norm([p.grad for p in params])).double().square().sum() if params \
        else torch.zeros((), dtype=torch.float64, device=stats["grad_norm"].device)
    grad_norm = (all_reduce(squares) if owners else squares).sqrt()
    if grad_clip:  # as torch's clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1
        scale = (grad_clip / (grad_norm + 1e-6)).clamp(max=1.0).float()
        torch._foreach_mul_([p.grad for p in params], scale)
    stats["grad_norm"] += grad_norm
    squares = torch.zeros(3, dtype=torch.float64, device=stats["grad_norm"].device)  # update, before, after
    for opt in optimizers:
        params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        grads = {p: p.grad for p in params}
        for p in params:
            p.grad = None
        for chunk in Muon.stacks(params) if isinstance(opt, Muon) else [[p] for p in params]:
            before = list(torch.stack(chunk).unbind(0))  # one copy of the chunk (same shapes)
            for p in chunk:
                p.grad = grads[p]
            opt.step()
            for p in chunk:
                p.grad = None
            before_norms, after_norms = torch._foreach_norm(before), torch._foreach_norm(chunk)
            torch._foreach_sub_(before, chunk)  # -> the update, negated
            squares += torch.stack([torch.stack(norms).double().square().sum()
                                    for norms in (torch._foreach_norm(before), before_norms, after_norms)])
    if owners:
        all_reduce(squares)
        broadcast_weights([p for p in model.parameters() if p.requires_grad], owners)
    update, before, after = squares.sqrt()
    stats["steps"] += 1
    stats["update_ratio"] += update / before
    stats["weight_norm_factor"] = torch.stack([stats["weight_norm_factor"], after / before, before / after]).max()
    weights = [p.detach() for p in model.parameters()]  # a finite loss can still overflow them
    stats["weights_finite"] &= torch.stack(torch._foreach_norm(weights, float("inf"))).isfinite().all()


@torch.no_grad()
def add_micro_batch_stats(stats, loss, parts, mask, stepped):
    """Add one micro-batch's loss and objective()'s parts; mask [B, T]; stepped: an optimizer step came before it."""
    sums = stats["sums"]
    sums["loss"] += loss
    for name in ("loss_policy", "loss_kl", "kl", "teacher_kl", "entropy"):  # the losses a pass, the rest per token
        if name in parts:
            sums[name] += parts[name] if name.startswith("loss") else (parts[name] * mask).sum()
    if stepped:  # before the first optimizer step pi_theta is pi_old: rho = 1, nothing can clip
        clipped = parts["clipped"] * mask  # low side: rho < 1 - eps_low with A < 0; high: rho > 1 + eps_high, A > 0
        sums["clipped_low"] += (clipped * (parts["log_ratio"] < 0)).sum()
        sums["clipped_high"] += (clipped * (parts["log_ratio"] > 0)).sum()
        sums["clip_tokens"] += mask.sum()
    sums["tokens"] += mask.sum()
    sums["sampler_gap"] += (parts["sampler_gap"].abs() * mask).sum()
    ratio = torch.exp(parts["log_ratio"]).expand_as(mask).masked_fill(mask == 0, 1.0)
    stats["ratio_min"] = torch.minimum(stats["ratio_min"], ratio.min())
    stats["ratio_max"] = torch.maximum(stats["ratio_max"], ratio.max())


def finish_update_stats(stats, args, with_kl, with_teacher=False):
    """-> the update's metrics, reduced over ranks: means over passes (losses) or over policy tokens."""
    sums = dict(zip(stats["sums"], all_reduce(torch.stack(list(stats["sums"].values())))))
    passes = args.ppo_epochs * args.num_minibatches
    tokens = sums["tokens"].clamp(min=1)
    return {
        **{name: (sums[name] / passes).item() for name in ("loss", "loss_policy")},
        "loss_kl": (sums["loss_kl"] / passes).item() if with_kl else None,
        "kl": (sums["kl"] / tokens).item() if with_kl else None,
        "teacher_kl": (sums["teacher_kl"] / tokens).item() if with_teacher else None,  # mean log pi_old - log pi_T
        **{name: (clipped / sums["clip_tokens"]).item() if sums["clip_tokens"] > 0 else None for name, clipped in (
            ("clip_frac", sums["clipped_low"] + sums["clipped_high"]), ("clip_frac_low", sums["clipped_low"]),
            ("clip_frac_high", sums["clipped_high"]))},
        "ratio_min": all_reduce(stats["ratio_min"], dist.ReduceOp.MIN).item(),
        "ratio_max": all_reduce(stats["ratio_max"], dist.ReduceOp.MAX).item(),
        "entropy": (sums["entropy"] / tokens).item(),
        "sampler_gap": (sums["sampler_gap"] / tokens).item(),  # mean |log pi_old - log pi_sampler|
        **{name: (stats[name] / stats["steps"]).item() if stats["steps"] else None  # grad_norm: before clipping
           for name in ("grad_norm", "update_ratio")},
        "weight_norm_factor": stats["weight_norm_factor"].item(),
        **{name: stats[name] for name in ("skipped_updates", "empty_updates", "no_signal_updates")},
        "weights_finite": bool(all_reduce(stats["weights_finite"].int(), dist.ReduceOp.MIN).item()),
    }


def state_bytes(entry):
    """The bytes of one weight's optimizer state (its momenta, second moments, step counter)."""
    return sum(v.numel() * v.element_size() for v in entry.values() if torch.is_tensor(v))


def optimizer_state_bytes(optimizers):
    return sum(state_bytes(entry) for opt in optimizers for entry in opt.state.values())


def lr_multiplier(step, args):
    """The learning rates' multiplier at this step (0-based): a linear warmup over --warmup-steps, then the schedule
    from 1 down to --min-lr-frac at --num-steps. With the defaults, nanochat's linear decay: 1 - step / num_steps."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / (args.num_steps - args.warmup_steps)  # 0 at the end of warmup
    decay = {"linear": 1 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress)), "constant": 1.0}
    return args.min_lr_frac + (1 - args.min_lr_frac) * decay[args.lr_schedule]


def set_learning_rates(optimizers, step, args):
    multiplier = lr_multiplier(step, args)
    for group in (group for opt in optimizers for group in opt.param_groups):
        group["lr"] = group["initial_lr"] * multiplier
    return multiplier


# -----------------------------------------------------------------------------
# The end of a step: its metrics and samples, its warnings, an eval and a save when due, a stop honoured

def record(run, metrics):
    if run.master and run.writes:
        with writing(), open(run.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if run.wandb:
            run.wandb.log(metrics, step=metrics["step"])


SAMPLE_COLUMNS = ["step", "index", "question", "reply", "reward", "advantage", "length", "truncated"]


def log_samples(args, run, step, groups, batch):
    """--log-samples replies of rank 0's groups to samples.jsonl (and a wandb table): each group's best and worst
    reply side by side (an all-equal group's one), the groups the update learns from (rewards differ) first."""
    G, rewards, samples = args.num_samples, groups["rewards"], groups["samples"]
    equal, advantages = batch["equal_groups"].tolist(), batch["advantages"].tolist()  # one copy from the device
    rows = [g * G + int(pick(rewards[g])) for g in sorted(range(len(rewards)), key=lambda g: equal[g])
            for pick in ((torch.argmax,) if equal[g] else (torch.argmax, torch.argmin))][:args.log_samples]
    table, lines = [], []
    for row in rows:
        index = int(groups["indices"][row // G])
        conversation, reply = graded(run.train_task, run.tokenizer, run.train_task[index], samples, row)
        table.append([step + 1, index, conversation["messages"][0]["content"], reply, rewards.flatten()[row].item(),
                      advantages[row], int(samples["lengths"][row]), bool(samples["truncated"][row])])
        # an episode's turns, one by one (reply: its last)
        lines.append(json.dumps(dict(zip(SAMPLE_COLUMNS, table[-1]), **episode_of(conversation))) + "\n")
    with writing(), open(run.samples_path, "a", encoding="utf-8") as f:
        f.writelines(lines)
    if run.wandb:
        run.wandb.log({"samples": sys.modules["wandb"].Table(columns=SAMPLE_COLUMNS, data=table)}, step=step + 1)


SIGNAL_LESS_STEPS = 20  # steps in a row of only equal groups (nothing to learn, but from a teacher) before a warning
WEIGHT_NORM_WARNING = 2.0  # one update changing the weights' norm by more warns (healthy: a few %, docs/reliability.md)


def end_of_step(args, run, step, groups, batch, stats, times, rounds, lr_multiplier, step_start):
    """Log the step's metrics, warn, stop on non-finite weights or losses, evaluate and save when due, honour a stop."""
    if run.launcher is not None and os.getppid() != run.launcher:  # torchrun was killed: do not train on as an orphan
        stop_run(run.run_dir, f"the torchrun launcher (pid {run.launcher}) is gone", "")
    weights_finite = stats.pop("weights_finite")
    metrics = step_metrics(args, run, step, groups, batch, stats, times, rounds, lr_multiplier)
    record(run, metrics)
    if run.master and run.writes and args.log_samples:
        log_samples(args, run, step, groups, batch)
    optional = "".join(f" | {label} {metrics[key]:{spec}}" for label, key, spec in (
        ("kl", "kl", ".4f"), ("teacher kl", "teacher_kl", ".4f"), ("clip", "clip_frac", ".3f"),
        ("turns", "episode_turns", ".2f")) if metrics.get(key) is not None)
    run.log(f"step {step + 1}/{args.num_steps} | reward {metrics['reward']:.3f} | equal groups "
            f"{metrics['equal_group_frac']:.2f} | len {metrics['reply_len']:.1f} | loss {metrics['loss']:+.4f}"
            f"{optional} | {time.time() - step_start:.2f}s (sample {times['time_sample']:.2f}, "
            f"logprobs {times['time_logprobs']:.2f}, update {times['time_update']:.2f}) "
            f"| {metrics['tokens_per_s']:.0f} tok/s")
    run.signal_less_steps = run.signal_less_steps + 1 if metrics["equal_group_frac"] == 1 and not run.teacher else 0
    if run.signal_less_steps == SIGNAL_LESS_STEPS:  # once a streak: the count goes past it while the streak lasts
        run.log(f"warning: steps {step + 2 - SIGNAL_LESS_STEPS}-{step + 1}: in every group all replies got the same "
                f"reward (equal groups 1.00, mean reward {metrics['reward']:.3f}), so no update had anything to learn "
                "from. What usually helps: an easier task or a curriculum, a grader that gives partial credit, a start "
                "checkpoint that already solves some problems, a teacher (--distill-coef, --teacher), more replies a "
                "question (--num-samples) or a warmer --temperature (docs/tasks.md)")
    run.bad_steps = run.bad_steps + 1 if stats["skipped_updates"] else 0
    if stats["skipped_updates"]:
        run.log(f"warning: step {step + 1}: non-finite loss, {stats['skipped_updates']} update(s) skipped")
    if stats["weight_norm_factor"] > WEIGHT_NORM_WARNING:
        run.log(f"warning: step {step + 1}: one update changed the weights' norm by a factor "
                f"{stats['weight_norm_factor']:.3g} (update/weight ratio {stats['update_ratio']:.3g}); the step sizes "
                f"are probably far too large (--lr, --matrix-lr, --embedding-lr, --unembedding-lr, --init-lr-frac, "
                f"--lora-lr)")
    if not weights_finite or run.bad_steps >= args.max_bad_steps:
        problem = ("the update made weights non-finite (NaN or inf)" if not weights_finite
                   else f"{run.bad_steps} steps in a row had a non-finite loss")
        stop_run(run.run_dir, f"step {step + 1}: {problem}; stopped without saving",
                 "lower the learning rates or set --grad-clip (a resumed run may change those)")
    last = step + 1 == args.num_steps
    stopping = STOP["at_step_end"] and stop_requested()  # a stop signal on any rank: every rank saves, stops
    evaluated = True  # the step's eval, when due, ran to its end
    if args.eval_every and ((step + 1) % args.eval_every == 0 or last):
        if stopping:  # saved first: an eval (minutes on a GPU) would outlast a launcher's grace period
            run.log(f"step {step + 1}: eval skipped ({stop_name()}): the step is saved first; --resume runs it")
        evaluated = not stopping and run_eval(args, run, step + 1, args.final_eval_examples if last else
                                              args.eval_examples) is not None
        stopping = not evaluated  # a stop signal during the eval abandoned it
    if not run.bad_steps and (stopping or last or (args.save_every and (step + 1) % args.save_every == 0)):
        optimizer_states = gathered_optimizer_states(run.optimizers, run.owners)  # every rank takes part
        if run.master:
            save_training_state(run.run_dir, run.tag, step + 1, run.model, run.ref_model, optimizer_states,
                                run.config, args.keep_states)
        # Every rank waits for rank 0's write: one that ended early would start the launcher's kill clock (30 s)
        stopping = (stop_requested() and STOP["at_step_end"]) or stopping  # the barrier; a stop during the save
    if stopping and not (last and evaluated):  # a last step whose eval a stop skipped: --resume runs it
        raise KeyboardInterrupt(f"{stop_name()} at the end of step {step + 1}")


def step_metrics(args, run, step, groups, batch, stats, times, rounds, lr_multiplier):
    """The step's metrics.jsonl line: the rewards and replies summed over the ranks, the update's statistics."""
    samples = groups["samples"]
    drawn = groups.get("drawn", groups)  # the policy's own rewards: also of the groups dynamic sampling left out
    names = [f"reward/{name}" for name in run.train_task.reward_terms]
    episodes = (dict(episode_ends(run.tokenizer, samples), episode_len=samples["lengths"].sum().item())  # all tokens
                if run.train_task.respond else {})
    local = dict(zip(names, drawn["terms"].flatten(0, 1).sum(dim=0)), groups=len(drawn["rewards"]),
                 replies=drawn["task_rewards"].numel(), reward=drawn["task_rewards"].sum(), rounds=rounds,
                 reward_group_std=drawn["rewards"].std(dim=1).sum(), kept_replies=groups["task_rewards"].numel(),
                 equal_group_frac=signal_less_groups(drawn, args).sum(), equal_groups_kept=batch["equal_groups"].sum(),
                 kept_groups=len(groups["prompts"]), reward_kept=groups["task_rewards"].sum(),
                 reply_len=samples["mask"].sum().item(), truncated_frac=samples["truncated"].sum().item(),  # sampled
                 tokens_sampled=(drawn["sampled"] if "drawn" in groups else samples["mask"]).sum().item(),
                 overlong_penalty=groups["penalty"].sum(), questions=rounds * len(groups["prompts"]), **episodes)
    sums = dict(zip(local, all_reduce(torch.tensor(list(local.values()), dtype=torch.float64,
                                                   device=run.device)).tolist()))  # over all ranks
    kept = sums["kept_replies"]
    state_mb = torch.tensor(optimizer_state_bytes(run.optimizers) / 2 ** 20, dtype=torch.float64, device=run.device)
    return {"step": step + 1, "reward": sums["reward"] / sums["replies"],
            **{name: sums[name] / sums["groups"] for name in ("reward_group_std", "equal_group_frac")},
            **{name: sums[name] / sums["replies"] for name in names}, **stats,
            **({"reward_kept": sums["reward_kept"] / kept,  # dynamic sampling: what the update saw
                "equal_group_frac_kept": sums["equal_groups_kept"] / sums["kept_groups"]} if "drawn" in groups else {}),
            **{name: sums[name] / kept for name in ("reply_len", "truncated_frac", "overlong_penalty", *episodes)},
            "sampling_rounds": sums["rounds"] / run.world_size, "questions_drawn": sums["questions"],
            "tokens_sampled": sums["tokens_sampled"],  # every reply's, kept or not
            "lr_multiplier": lr_multiplier, **times, "tokens_per_s": sums["tokens_sampled"] / times["time_sample"],
            "optimizer_state_mb": all_reduce(state_mb, dist.ReduceOp.MAX).item(),  # the largest rank's
            "peak_mem_mb": (torch.cuda.max_memory_allocated(run.device) / 2 ** 20 if run.device.type == "cuda"
                            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "wall_time": time.time() - run.wall_start}


def stop_requested():
    """Whether a stop signal reached any rank (one small all-reduce a step on several; on one, no device read)."""
    return all_reduce(torch.tensor(float(STOP["received"] is not None)), dist.ReduceOp.MAX).item() > 0


def stop_name():
    return STOP["received"] or "a stop signal on another rank"


def save_training_state(run_dir, tag, step, model, ref_model, optimizer_states, config, keep_states):
    checkpoint_dir = os.path.join(run_dir, "chatrl_checkpoints", tag)
    with writing():  # a stop signal waits for the whole step, so that it is the checkpoint the stop line names
        # the resume state first, the model after: a step counts as saved once its model file exists
        atomic_save({"step": step, "optimizers": optimizer_states, "master_weights": master_weights(model),
                     "ref_model": ref_model.state_dict() if ref_model not in (None, model) else None},
                    os.path.join(checkpoint_dir, f"state_{step:06d}.pt"))
        save_checkpoint(checkpoint_dir, step, model, {"nanogrpo_config": config})
        # Only now that this step is complete may older states go (several times the model's size); every model
        # file stays, so nanochat can load any saved step. --keep-states 0 keeps all ([:-0] is empty).
        for old in complete_steps(checkpoint_dir)[:-keep_states]:
            os.remove(os.path.join(checkpoint_dir, f"state_{old:06d}.pt"))


# -----------------------------------------------------------------------------
# The run: main, and the one-line stops (a signal, out of memory, a lost rank, a full disk)

def main(argv=None):
    STOP.update(received=None, since=0.0, at_step_end=False)
    args = resolve_config(argv)
    if args.compare:  # the plot beside the runs when they share a folder, else in the current one
        folders = {os.path.dirname(os.path.abspath(os.path.normpath(d))) for d in args.compare}
        plot_path = args.compare_out or os.path.join(folders.pop() if len(folders) == 1 else ".", "compare.png")
        try:
            return compare_runs(args.compare, plot_path if args.plot else None)
        except OSError as e:  # the table is printed: only the plot is missing
            sys.exit(f"error: cannot write the plot {plot_path} ({e.strerror}): pass --compare-out with a file in a "
                     "writable folder")
    run_dir = os.path.join(args.runs_dir, args.run_name)
    if args.resume and not os.path.isdir(run_dir):  # a run that never was: said before any folder is made
        sys.exit(f"error: --resume: no checkpoint with training state in {run_dir}: no run was started there (check "
                 "--runs-dir and --run-name, or drop --resume to start one)")
    rank = launched()[0]
    writes = not (args.eval_only or args.ask)  # nothing of the run's (--resume --eval-only: its own result only)
    with stop_signals():  # a repeat of the stop's signal while the stop is reported changes nothing
        try:
            with lock_run_dir(run_dir) if rank == 0 and (writes or (args.eval_only and args.resume)) else nullcontext():
                run = start_run(args, run_dir, rank, writes)
                if args.eval_only or args.ask:
                    result = ask(args, run) if args.ask else run_eval(args, run, run.start_step if args.resume else
                                                                      run.model.start_step, args.final_eval_examples)
                    leave_process_group()
                    return result
                STOP["at_step_end"] = args.save_on_stop  # from here a first stop signal: the step ends, saved
                first_eval(args, run)
                train(args, run)
                STOP["at_step_end"] = False
                run.log(f"done: {args.num_steps} steps in {time.time() - run.wall_start:.0f}s; "
                        f"metrics in {run.metrics_path}")
                if run.master:  # the summary: this run as a one-row comparison table, and its curves
                    compare_runs([run_dir], os.path.join(run_dir, "curves.png") if args.plot else None)
                leave_process_group()
                return run.model
        except OSError as e:  # a write refused (disk full, quota, read-only, permissions): the user's to fix, not a bug
            if e.errno not in {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}:
                raise
            stop_run(run_dir, f"cannot write {e.filename or 'into ' + run_dir}: {e.strerror}",
                     "free disk space or make the folder writable")
        except torch.OutOfMemoryError as e:
            stop_run(run_dir, *out_of_memory(args, launched()[1], e.__traceback__))
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (schedulers), by stop_signals
            stop_run(run_dir, f"stopped by {e.args[0]}" if e.args else "interrupted", "")
        except GraderError as e:  # a changed grader does not resume a run (its sha256 is an input): a new one
            stop_run(run_dir, str(e), "fix the function", resume=False)
        except RuntimeError as e:
            if not (dist.is_initialized() and (isinstance(e, dist.DistBackendError) or "/gloo/" in str(e))):
                raise
            world_size = dist.get_world_size()
            other = f"rank {1 - rank}" if world_size == 2 else "another rank"
            if STOP["received"]:  # signalled too (a terminal's Ctrl-C, a scheduler): the other ended on a second one
                stop_run(run_dir, f"stopped by {STOP['received']}; {other} ended at once, on a second signal, before "
                         "this rank reached the step's end", "")
            stop_run(run_dir, f"rank {rank} of {world_size}: lost {other}, which did not answer within --dist-timeout "
                     f"{args.dist_timeout} s or ended ({str(e).splitlines()[0][:200]})", "look for the cause in the "
                     "other ranks' output (a crash, a hung read; --dist-timeout allows longer)")


def launched():  # -> (rank, number of processes), as torchrun sets them; a plain `python grpo.py`: 0 of 1
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def out_of_memory(args, world_size, trace):
    """-> (problem, remedy) for an out-of-memory error: the phase it arose in (the innermost of OOM_PHASES on its
    traceback), the sizes that drove that phase's memory, and the flags that lower them."""
    phase = next((frame.name for frame in reversed(traceback.extract_tb(trace)) if frame.name in OOM_PHASES), None)
    rows = args.prompts_per_step // world_size * args.num_samples
    if phase == "sample_groups":
        per_call = min(rows, max(args.num_samples, args.sample_batch_size or rows))
        return (f"out of GPU memory while sampling: {per_call} replies of up to {args.max_new_tokens} new tokens a "
                f"generate call (--sample-batch-size; this rank's step: {rows} replies), their KV cache and logits",
                f"lower --sample-batch-size (the same replies, in more calls; at least one group, --num-samples "
                f"{args.num_samples}), or --max-new-tokens")
    if phase in ("frozen_logprobs", "policy_update"):
        what = "computing the old and reference log-probs" if phase == "frozen_logprobs" else "in the update"
        if args.pack and not args.device_batch_size:
            return (f"out of GPU memory {what}: --tokens-per-pass {args.tokens_per_pass} tokens a forward pass",
                    "lower --tokens-per-pass (at least the longest prompt and reply), or give --device-batch-size "
                    "(rows a pass): the result is the same, in more passes")
        packed = "packed " if args.pack else ""  # with --device-batch-size: rows of whole questions a pass
        return (f"out of GPU memory {what}: --device-batch-size {args.device_batch_size} {packed}rows a forward pass, "
                f"each a prompt and up to {args.max_new_tokens} reply tokens", "lower --device-batch-size (the "
                "result is the same, in more passes) or --max-new-tokens")
    if phase == "evaluate":
        return (f"out of GPU memory in the eval: {EVAL_BATCH} problems a batch, x {max(1, args.pass_k)} replies of up "
                f"to {args.eval_max_new_tokens} tokens", "lower --pass-k or --eval-max-new-tokens")
    return ("out of GPU memory outside sampling, log-probs, update and eval: the model, its reference copy and "
            "optimizer state take too much", "train fewer weights (--lora-rank), keep the reference in bf16 "
            "(--ref-dtype bfloat16) or use a GPU with more memory")


OOM_PHASES = ("sample_groups", "frozen_logprobs", "policy_update", "evaluate")  # what out_of_memory reports against
# A stop signal during the steps (--save-on-stop), its name and when it came: end_of_step saves the step and stops.
STOP = {"received": None, "since": 0.0, "at_step_end": False}


@contextmanager
def stop_signals():
    """Ctrl-C, SIGTERM and SIGHUP (SLURM and other schedulers) end a run with the one-line stop, after a file being
    written is whole (model.writing); with --save-on-stop, after the step under way is saved (stop_at_step_end)."""
    previous = {sig: signal.signal(sig, stop_at_step_end) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                if threading.current_thread() is threading.main_thread()}  # a handler only the main thread may set
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_at_step_end(signum, frame):
    """Signal handler: during the steps the first stop signal is noted and the step goes on (end_of_step saves it);
    a second one (not a torchrun repeat), or one outside the steps, stops at once (after a write under way)."""
    name, now = signal.Signals(signum).name, time.monotonic()
    # under torchrun a job's signal reaches each worker twice (forwarded): a repeat within 2 s is one stop
    repeat = 2.0 if "TORCHELASTIC_RUN_ID" in os.environ else 0.0
    if STOP["received"] == name and now - STOP["since"] < repeat:
        return
    first = STOP["at_step_end"] and not STOP["received"]
    STOP.update(received=name, since=now)
    if not first:
        return stop_signal(signum, frame)
    if launched()[0] == 0:  # a raw write: a print could land inside another print's buffer
        second = f"a second signal, {repeat:.0f} s or more after this one," if repeat else "a second one"
        os.write(2, f"{name}: the run stops: a step under way is finished and saved first, an eval is left at the end "
                    f"of its batch for --resume to run ({second} stops it at once)\n".encode())


def stop_run(run_dir, problem, remedy, resume=True):
    """Exit with one line: what went wrong, the run's newest complete checkpoint, and how to go on from it (resume
    False: the remedy changes an input --resume checks, so a new run). Only rank 0, which writes them, names one."""
    if (rank := launched()[0]) != 0:
        sys.exit(f"error: {problem}" + (f"; {remedy}" if remedy else "") + f" (rank {rank}: rank 0's line names the "
                 "checkpoint to go on from)")
    found = sorted((s, d) for d in glob.glob(os.path.join(glob.escape(run_dir), "chatrl_checkpoints", "*"))
                   for s in complete_steps(d))
    then = f"{remedy}, then " if remedy else ""
    if found:
        step, checkpoint_dir = found[-1]
        sys.exit(f"error: {problem}. The run's newest checkpoint, step {step} in {checkpoint_dir}, is complete and "
                 "unchanged: " + (f"{then}go on from it with --resume" if resume else f"{then}start a new run from it "
                                   f"(--init {checkpoint_dir}, another --run-name): --resume refuses changed inputs"))
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        sys.exit(f"error: {problem}. Nothing of this run was written yet: {then}run the command again")
    if not resume and discard_unstarted(run_dir):
        sys.exit(f"error: {problem}. The run stopped before its first step, and its files are removed: {then}run the "
                 "command again")
    sys.exit(f"error: {problem}. No checkpoint of this run was saved: {then}" + (
        "start it over from step 0 with the same command and --resume" if resume
        else "run the command again with another --run-name (--resume refuses changed inputs)"))


# -----------------------------------------------------------------------------
# Setting a run up: processes and devices, tasks, the start policy, its reference, teacher and optimizers

def start_run(args, run_dir, rank, writes):
    """Everything train() needs, one namespace (resumed: at its last checkpoint); writes False: nothing written."""
    evaluating = bool(args.eval_only or args.ask)  # the start policy only: no optimizers, reference or teacher
    teaching = args.distill_coef > 0 and not evaluating
    world_size, device, master, log, dtype, autocast = start_process(args, rank)
    train_task, test_task, watched = read_tasks(args)
    if teaching:
        teacher_checkpoint(args)
    # after the inputs: a wrong path or --teacher says so whatever the run folder holds
    if writes and not args.resume and os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        parser.error(f"{run_dir} already holds a run: pass --resume to continue it, or another --run-name")
    if args.resume:
        same_version(run_dir)
    config = {k: v for k, v in vars(args).items()
              if k not in flags_with("unrecorded") + ("notes", "run_settings", "given")}
    config.update(world_size=world_size, version=VERSION)
    setup_log = (lambda line: None) if args.ask else log  # --ask prints its answer, and the few lines it rests on
    setup_log("configuration:\n" + "\n".join(f"  {k} = {v}" for k, v in config.items()) if args.show_config else
              f"settings: {as_flags({k: vars(args)[k] for k in args.given}) or 'the defaults'} (the flags given; "
              "config.json holds every setting, --show-config prints them)")
    for name, spec in zip(watched, args.eval_task):  # a file only watched is a quiz: all of it counts
        setup_log(f"watched: {name}, {len(watched[name])} problems" + (" (the whole file)" if spec.endswith(".jsonl")
                                                                         else " (its test split)"))
    static_pack = None
    if not evaluating:  # an evaluation's memory is the model's and the eval's (EVAL_BATCH), not a step's
        longest_prompt = plan_memory(args, world_size, device, dtype, train_task, log)  # config: the chunks it fits
        config.update((k, getattr(args, k)) for k in ("device_batch_size", "sample_batch_size", "tokens_per_pass"))
        if args.compile and args.pack:  # a compiled forward's one shape: a minibatch's rows at the longest width
            static_pack = (minibatch_rows(args, world_size), longest_prompt + args.max_new_tokens - 1)
    model, tokenizer, tag, optimizers, owners, ref_model = build_models(args, config, world_size, device, dtype,
                                                                        setup_log, evaluating)
    teacher = teacher_digest = None
    if teaching:
        teacher, teacher_digest = load_teacher(args, tokenizer, log)
        teacher = frozen(teacher if args.teacher_offload else teacher.to(device), dtype == "bfloat16",
                         args.teacher_offload and device.type == "cuda")
        teacher.use_compile = args.compile
    record_inputs(config, args, train_task, test_task, watched, tokenizer, teacher_digest)
    attempts_budget(args, tokenizer, setup_log)
    run = SimpleNamespace(rank=rank, world_size=world_size, master=master, log=log, device=device, autocast=autocast,
                          train_task=train_task, test_task=test_task, watched=watched, model=model, tokenizer=tokenizer,
                          ref_model=ref_model, teacher=teacher, optimizers=optimizers, owners=owners, config=config,
                          static_pack=static_pack, run_dir=run_dir, tag=tag, wandb=None, writes=writes, start_step=0,
                          checkpoint_dir=os.path.join(run_dir, "chatrl_checkpoints", tag), bad_steps=0,
                          metrics_path=os.path.join(run_dir, "metrics.jsonl"), signal_less_steps=0,
                          samples_path=os.path.join(run_dir, "samples.jsonl"), start_evaluated=False,
                          launcher=os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None)
    if args.resume:
        run.start_step = resume(args, run)
        setup_log(f"resumed from step {run.start_step} of {run.checkpoint_dir}")
    if args.self_check if args.self_check is not None else device.type == "cuda":
        self_check(args, run)  # before anything is written: a fast path that is wrong stops the run here
    # after the configuration, the plan and the self-check: the last lines before the steps (--ask's: after its first)
    for note in args.notes if not args.ask else ():
        log(f"note: {note}")
    if args.eval_only:
        log(f"--eval-only: {evaluation_settings(args)}")
    wall_before = write_run_files(args, run) if writes else 0.0
    run.wall_start = time.time() - wall_before
    if args.wandb and master and writes:
        import wandb
        run.wandb = wandb.init(project=args.wandb, name=args.run_name, config=config)
    return run


def start_process(args, rank):
    """This rank's device, threads, precision -> (world_size, device, master, log (rank 0 prints), dtype, autocast)."""
    world_size = launched()[1]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":  # --device cuda: each process its own GPU, LOCAL_RANK's (a plain `python grpo.py`: 0)
        device = device if device.index is not None else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        timeout = timedelta(seconds=args.dist_timeout)  # a rank that hangs stops the others after this long
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    threads = thread_policy(args, device, world_size)
    if not args.ask:  # its answer comes first
        log(threads)
    if args.compile is None:  # a compile costs a minute or more: worth it on a GPU, not for the CPU's small runs
        args.compile = device.type == "cuda"
    # Mixed precision is autocast on CPU and GPU alike: matmuls in bf16, weights and optimizer state in float32.
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    torch.manual_seed(args.seed)
    return world_size, device, master, log, dtype, autocast


def thread_policy(args, device, world_size):
    """Set this process's CPU threads for the run -> the line that says how many and why. The count is fixed for
    the whole run: a reduction's last bits may depend on it, and the same seed on the same machine is the same run."""
    if device.type != "cpu":
        return f"threads: {torch.get_num_threads()} on the host (the work is on {device.type})"
    omp = "OMP_NUM_THREADS" in os.environ
    if args.threads or (world_size > 1 and not omp):  # several ranks: one each, as torchrun sets it (they share cores)
        torch.set_num_threads(args.threads or 1)
    why = ("--threads" if args.threads else "OMP_NUM_THREADS" if omp else
           "one per rank, as torchrun's" if world_size > 1 else "torch's default, one per core")
    spin = (f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}" if "OMP_WAIT_POLICY" in os.environ else
            f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}")
    return f"threads: {torch.get_num_threads()} ({why}; {spin}; --threads N sets it)"


def leave_process_group():
    if dist.is_initialized():  # together: a rank that tears gloo down while the master still writes can abort
        dist.barrier()
        dist.destroy_process_group()


def read_tasks(args):
    """-> (train, test, {name: watched}); bad data or no start checkpoint: one error line, before the configuration."""
    try:
        train_task, test_task = (build(args.task, split, args) for split in ("train", "test"))
        watched = {task_name(spec): build(spec, "test", args) for spec in args.eval_task}
    except (OSError, ValueError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    start_checkpoint_dir(args)
    if args.num_steps is None:  # the task's default needed its data: one epoch
        args.num_steps = max(1, len(train_task) // args.prompts_per_step)
        if args.warmup_steps >= args.num_steps:
            parser.error(f"--warmup-steps {args.warmup_steps} leaves no step of the schedule (one epoch of "
                         f"{args.task}: {args.num_steps} steps)")
    if args.prompts_per_step > len(train_task) and not (args.ask or args.eval_only):  # a step's, not a question's
        sys.exit(f"error: --prompts-per-step {args.prompts_per_step} is more than the {len(train_task)} questions of "
                 "the train split: a step would hold a question twice; lower it (--num-samples sets the replies each)")
    return train_task, test_task, watched


def build_models(args, config, world_size, device, dtype, log, evaluating=False):
    """-> (model, tokenizer, tag, optimizers, owners (each weight's rank if sharded), ref_model); evaluating: model."""
    model, tokenizer, tag = load_policy(args, log)
    model.to(device)
    model.use_compile = args.compile  # the reference, a copy of the model, inherits it
    if args.lora_rank:  # before the optimizers: the adapters are the only weights that train
        model.add_lora(args.lora_rank, args.lora_alpha, args.seed)
    if args.optimizer == "muon" and not args.lora_rank:  # recorded, so that a resume steps with the same one
        args.optimizer_version = config["optimizer_version"] = optimizer_version(model, args)
        recorded = " (the start checkpoint's, as its meta records)" if getattr(
            model, "trained_optimizer", None) == args.optimizer_version else ""
        if not evaluating:
            log(f"optimizer: nanochat's Muon + AdamW, version {args.optimizer_version}{recorded} (docs/optimizers.md)")
    if evaluating:
        return model, tokenizer, tag, [], None, None
    optimizers = make_optimizers(model, args)
    owners = None
    if args.shard_optimizer and world_size > 1:
        owners = shard_owners([p for p in model.parameters() if p.requires_grad], world_size)
        log(f"optimizer state sharded over the {world_size} ranks, each weight's on one (--no-shard-optimizer: on all)")
    if args.ref_dtype == "bfloat16" and dtype != "bfloat16":
        parser.error("--ref-dtype bfloat16 needs --dtype bfloat16 (a float32 forward cannot take bfloat16 weights)")
    # no KL term: no reference; with LoRA, the base model: the policy with its adapters switched off, no second copy
    ref_model = None if args.kl_coef == 0 else model if args.lora_rank else frozen(
        copy.deepcopy(model), (args.ref_dtype or dtype) == "bfloat16", args.ref_offload and device.type == "cuda")
    return model, tokenizer, tag, optimizers, owners, ref_model


def attempts_budget(args, tokenizer, log):
    """--attempts N: the tokens its episodes need at least (a sampled token and its end a reply, and each retry's
    forced feedback), said at start, with a note for a budget that cannot hold all N attempts."""
    if args.attempts == 1:
        return
    feedbacks = [3 + len(tokenizer.encode(Attempts.feedback(left))) for left in range(args.attempts - 1, 0, -1)]
    # + 1: a turn that ends on the budget's last column cannot ask for the next (the episode counts as cut)
    least, feedback = 2 * args.attempts + sum(feedbacks) + 1, feedbacks[0]  # each retry's forced run, longest first
    most = f", {args.attempts * (args.max_turn_tokens + 1) + sum(feedbacks) + 1} for {args.attempts} full turns of " \
        f"--max-turn-tokens {args.max_turn_tokens}" if args.max_turn_tokens else ""
    log(f"--attempts {args.attempts}: an episode needs at least {least} tokens (2 a reply, {feedback} for each retry's "
        f"forced feedback){most}")
    for flag in ("eval_max_new_tokens",) if args.eval_only or args.ask else ("max_new_tokens", "eval_max_new_tokens"):
        if getattr(args, flag) < least:
            fit = max(1, (getattr(args, flag) + feedback) // (2 + feedback))
            log(f"note: --{flag.replace('_', '-')} {getattr(args, flag)} holds {fit} of the {args.attempts} attempts "
                f"at most: raise it to at least {least}")


def record_inputs(config, args, train_task, test_task, watched, tokenizer, teacher_digest):
    """config.json's "inputs" (sha256s of what the run rests on besides its flags, for --resume) and "scores"."""
    config["inputs"] = {"train": train_task.fingerprint(), "test": test_task.fingerprint(),
                        "tokenizer": hashlib.sha256(pickle.dumps(tokenizer.enc)).hexdigest(),
                        **({"teacher": teacher_digest} if teacher_digest is not None else {})}
    config["scores"] = {"": train_task.score, **{name: task.score for name, task in watched.items()}}  # --compare's
    for spec in [args.task] + args.eval_task + [args.grader] * (args.grader not in GRADERS):  # their code, like data
        if code := code_fingerprint(spec):
            config.setdefault("task_code", {})[spec] = code
            config["inputs"][f"code:{spec}"] = code["sha256"]
    config["inputs"].update((f"watched:{name}", task.fingerprint()) for name, task in watched.items())


def load_policy(args, log, shapes_only=False):
    """--init sft | scratch | <checkpoint dir> -> (model, tokenizer, tag); shapes_only: on the meta device, unread."""
    if args.init == "scratch":
        tokenizer = Tokenizer.byte_level()
        config = GPTConfig(sequence_len=1024, vocab_size=tokenizer.vocab_size, n_layer=args.depth,
                           n_head=args.n_head, n_kv_head=args.n_head, n_embd=args.n_embd)
        with torch.device("meta") if shapes_only else nullcontext():
            model = GPT(config) if shapes_only else GPT(config).init_weights(args.seed)
        model.start_step = 0
        return model, tokenizer, f"d{args.depth}"
    checkpoint_dir = start_checkpoint_dir(args)
    try:
        model, meta = load_checkpoint(checkpoint_dir, args.init_step, generation=args.generation,
                                      window_pattern=args.window_pattern, log=log, shapes_only=shapes_only)
        tokenizer = Tokenizer.from_file(tokenizer_path(checkpoint_dir))
    except CheckpointFileError as e:
        unusable_checkpoint("--init", e, loadable_steps(checkpoint_dir))
    except (OSError, ValueError) as e:
        sys.exit(f"error: --init: {e}")
    model.start_checkpoint = f"{checkpoint_dir}, step {meta.get('step')}"  # meta: a dict (read_meta checks it)
    model.start_step = meta.get("step", 0)  # what --eval-only's line names
    trained = meta.get("nanogrpo_config")  # a checkpoint of this program
    model.trained_optimizer = trained.get("optimizer_version") if isinstance(trained, dict) else None
    return model, tokenizer, os.path.basename(os.path.normpath(checkpoint_dir))


def start_checkpoint_dir(args):
    """--init sft | <checkpoint dir> -> the folder to start from (None for scratch); one error line if there is none."""
    if args.init == "scratch":
        return None
    if args.init != "sft":
        folder = checkpoint_folder(args.init)
        if not checkpoint_steps(folder):
            sys.exit(f"error: --init: no model_<step>.pt files in {os.path.abspath(args.init)}: name a nanochat "
                     "checkpoint folder (e.g. <base>/chatsft_checkpoints/d20) or a run folder of grpo.py, or use "
                     "--init sft")
        return folder
    try:
        return find_checkpoint(tag=args.model_tag)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}; train a chat model with nanochat first, or try the CPU demo: python grpo.py --demo")


def frozen(net, bf16_matrices, offload):
    """A model that does not train (reference, teacher), without gradients. bf16_matrices: its matrices in bf16, half
    the memory, the same numbers (autocast casts them anyway). offload: in pinned CPU memory (on_device)."""
    net.requires_grad_(False).eval()
    for module in net.modules():
        if bf16_matrices and isinstance(module, torch.nn.Linear):
            module.to(torch.bfloat16)
    if offload:
        for p in net.parameters():
            p.data = p.data.cpu().pin_memory()
    return net


@contextmanager
def on_device(module, device, offload):
    """--ref-offload, --teacher-offload: a module's CPU weights on the device for the block (unchanged: not copied)."""
    kept = [p.data for p in module.parameters()] if offload and device.type != "cpu" else []
    for p, cpu in zip(module.parameters(), kept):
        p.data = cpu.to(device, non_blocking=True)
    try:
        yield
    finally:
        for p, cpu in zip(module.parameters(), kept):
            p.data = cpu


def teacher_checkpoint(args):
    """--teacher DIR (a checkpoint or run folder) and --teacher-step -> (folder, step); one error line if none."""
    folder = checkpoint_folder(args.teacher)
    complete = loadable_steps(folder)
    if not complete:
        sys.exit(f"error: --teacher: no model_<step>.pt with its meta_<step>.json in {os.path.abspath(args.teacher)}: "
                 "name a nanochat checkpoint folder (e.g. <base>/chatsft_checkpoints/d32) or a run folder of grpo.py")
    step = complete[-1] if args.teacher_step is None else args.teacher_step
    if step not in checkpoint_steps(folder):  # one without its meta: load_checkpoint's line, as a damaged step's
        sys.exit(f"error: --teacher-step {step}: {folder} holds steps {complete}")
    return folder, step


def load_teacher(args, tokenizer, log, shapes_only=False):
    """--teacher, in float32 on the CPU (shapes_only: on the meta device) -> (model, fingerprint for --resume: sha256
    of its meta file, its model file's size and first and last MiB). Its tokenizer must be the policy's."""
    folder, step = teacher_checkpoint(args)
    try:
        teacher, _ = load_checkpoint(folder, step, log=log, shapes_only=shapes_only)
        teacher_tokenizer = Tokenizer.from_file(tokenizer_path(folder))
    except CheckpointFileError as e:
        unusable_checkpoint("--teacher", e, loadable_steps(folder))
    except (OSError, ValueError) as e:
        sys.exit(f"error: --teacher: {e}")
    reads = [(t.enc._pat_str, t.enc._mergeable_ranks, t.enc._special_tokens) for t in (tokenizer, teacher_tokenizer)]
    if reads[0] != reads[1]:
        policy_file = tokenizer_path(start_checkpoint_dir(args)) if args.init != "scratch" else \
            "the byte-level one of --init scratch"
        sys.exit(f"error: --teacher's tokenizer ({tokenizer_path(folder)}) is not the policy's ({policy_file}): "
                 "distillation compares the two models' log-probs of the same token ids; pick a teacher trained "
                 "with the policy's tokenizer")
    model_path = os.path.join(folder, f"model_{step:06d}.pt")
    with open(os.path.join(folder, f"meta_{step:06d}.json"), "rb") as meta, open(model_path, "rb") as weights:
        digest = hashlib.sha256(meta.read())
        size = os.fstat(weights.fileno()).st_size
        digest.update(str(size).encode() + weights.read(2 ** 20))
        weights.seek(max(0, size - 2 ** 20))
        digest.update(weights.read())
    log(f"teacher: {folder}, step {step}, {sum(p.numel() for p in teacher.parameters()) / 1e6:.1f}M parameters")
    return teacher, digest.hexdigest()


def unusable_checkpoint(flag, error, steps):
    """Exit with one line for a checkpoint file that cannot be used (error: a CheckpointFileError) and how to go on:
    another step of its folder (steps: loadable_steps, for --resume those with training state), or another one."""
    folder, name = os.path.split(error.path)
    step = int(re.search(r"_(\d+)\.", name).group(1))
    others = [s for s in steps if s != step]
    listed = ", ".join(map(str, steps)) if len(steps) <= 10 else f"{steps[0]} to {steps[-1]}, {len(steps)} in all"
    if not others:
        instead = ("no other step of the run has its training state" if flag == "--resume" else
                   f"no other step in {folder} has its model and meta files: copy that file again from where it came")
    else:
        earlier = [s for s in others if s < step]
        other = max(earlier) if earlier else min(others)  # the step before it, else the nearest after
        whole = f"the steps with model and meta files: {listed}"
        instead = {"--init": f"start from step {other} instead (--init-step {other}; {whole})",
                   "--teacher": f"use its step {other} instead (--teacher-step {other}; {whole})",
                   "--resume": f"move step {step}'s model, meta and state files out of the folder to resume from step "
                               f"{other} (the steps with training state: {listed})"}[flag]
    elsewhere = {"--init": "start from another checkpoint with --init", "--teacher": "name another --teacher",
                 "--resume": "start a new run from a checkpoint with --init"}[flag]
    sys.exit(f"error: {flag}: {error}; {instead}, or {elsewhere}")


# -----------------------------------------------------------------------------
# The self-check: the update's own pass against the plain one on a few real rows (model.py makes the rows)

# A fast path may be at most this many times as far from the float32 plain path as the run's plain path is (its
# dtype's rounding), plus SELF_CHECK_FLOOR (a float32 run's own rounding).
SELF_CHECK_FACTOR, SELF_CHECK_FLOOR = 2.0, 1e-4


def self_check(args, run, questions=4, new_tokens=16):
    """The run's fast paths against the plain float32 one, before the first step: its decode's replies to a few train
    questions, their log-probs and gradient on each path, a batch of its own (G = 2). Beyond a bound, all ranks stop."""
    start, model, tokenizer = time.time(), run.model, run.tokenizer
    check = SimpleNamespace(**dict(vars(args), num_samples=2, num_minibatches=1, aggregation="token",
                                   drop_equal_groups=False, mask_truncated=False, reward_combination="sum",
                                   advantage="mean", kl_coef=0.0, rollout_correction="off",
                                   distill_coef=args.distill_coef if run.teacher is not None else 0.0))
    prompts = [tokenizer.render_for_completion(run.train_task[i]) for i in range(min(questions, len(run.train_task)))]
    try:
        with noisy_projections(model, args.seed) as zero:
            with run.autocast:
                prompts, samples, ends = self_check_replies(model, tokenizer, prompts, check.num_samples, min(
                    new_tokens, args.max_new_tokens), args.temperature, args.seed, args.decode)
            results = self_check_paths(args, run, check, prompts, samples)
    finally:
        for net in [model] + ([run.teacher] if run.teacher is not None else []):
            net.use_compile = args.compile
    checks = all_reduce(self_check_distances(results, ("logprobs", "grads", "teacher", "kl")), dist.ReduceOp.MAX)
    self_check_verdict(args, run, checks.tolist(), ends, zero, time.time() - start)  # the worst rank's distances


def self_check_paths(args, run, check, prompts, samples):
    """The check's replies through the run's own path ("fast"), the plain one ("plain": padded rows, eager) and the
    plain one in float32 -> {path: dict(logprobs, grads, sampler, teacher (its top-k log-probs, sorted: near-ties swap
    ids, not values, and the rest's; or the tokens'), kl (at the top-k))}. Every path's student takes the fast path's
    teacher: its gather compared at the same tokens, the teacher's forward on its own."""
    model, teacher, G = run.model, run.teacher, check.num_samples
    rows, nets = len(prompts) * G, [model] + ([teacher] if teacher is not None else [])
    plain = SimpleNamespace(**dict(vars(check), pack=False, device_batch_size=rows))
    paths = {"fast": (check, run.autocast), "plain": (plain, run.autocast), "float32": (plain, nullcontext())}
    params = [p for p in model.parameters() if p.requires_grad]
    advantages = torch.randn(rows, 1, generator=torch.Generator().manual_seed(args.seed)).to(run.device)
    forward = teacher is not None and check.distill_divergence == "forward"
    results, taught = {}, None  # taught: the fast path's teacher, its tensors in the rows' layout [N, T, ...]
    for name, (path_args, autocast) in paths.items():
        batch = to_device(make_batch(prompts, samples, torch.zeros(len(prompts), G), path_args,
                                     run.static_pack if path_args.pack else None), run.device)
        micro_batches, mask = batch["micro_batches"], batch["loss_mask"]
        for net in nets:
            net.use_compile = args.compile and name == "fast"
        terms, own = [None] * len(micro_batches), []  # the teacher's term of each, as the update takes it
        if teacher is not None:  # through this path; float32: its bf16 matrices upcast for the while
            with on_device(teacher, run.device, args.teacher_offload), float32_matrices(teacher, name == "float32"):
                terms = teacher_terms(teacher, micro_batches, path_args, autocast)
            # in the rows' layout [N, T, ...]: (ids, top-k log-probs, the rest's or None), or (log-probs,)
            own = [batch_rows(parts, micro_batches, mask) for parts in zip(*[
                (in_rows(t["ids"], mb), *t["logprobs"]) if forward else (t,) for t, mb in zip(terms, micro_batches)])]
        taught = own if name == "fast" else taught
        logprobs, kl, loss = torch.zeros_like(mask), torch.zeros_like(mask), 0.0  # [N, T]
        for term, mb in zip(terms, micro_batches):
            if name != "fast" and teacher is not None:  # the fast path's, cut to this pass's padded rows
                part = [None if t is None else t[mb["rows"], :mb["input_ids"].size(1)] for t in taught]
                term = {"ids": part[0], "logprobs": (part[1], part[2])} if forward else part[0]
            with autocast:
                mb_loss, parts, mb_logprobs = micro_batch_loss(model, mb, None, None, term, advantages[mb["rows"]],
                                                               mask.sum(), path_args)
            loss = loss + mb_loss
            logprobs[mb["rows"], :mb_logprobs.size(1)] = mb_logprobs.float() * mb["loss_mask"]
            if forward:
                kl[mb["rows"], :mb_logprobs.size(1)] = parts["teacher_kl"].float() * mb["loss_mask"]
        values = mask.new_zeros(0) if teacher is None else torch.cat(  # [N, T, k + 1 or 1]
            [t.view(t.shape[:2] + (-1,)) for t in own[1 if forward else 0:] if t is not None], 2) * mask[..., None]
        results[name] = dict(logprobs=logprobs, sampler=batch["sampler_logprobs"] * batch["sampled_mask"],
                             grads=torch.cat([g.flatten().float() for g in torch.autograd.grad(loss, params)]),
                             teacher=values, kl=kl if forward else mask.new_zeros(0))
    return results


def self_check_verdict(args, run, checks, ends, zero, seconds):
    """checks (the fast and plain paths' distances from float32 of each key, then the decode's) against their bounds."""
    fast_path = (("packed passes" + (" (flash attention)" if run.device.type == "cuda" else "") if args.pack
                  else "padded rows") + (", compiled" if args.compile else ""))
    fast_flag = " and ".join(flag for flag, on in (("--no-pack", args.pack), ("--no-compile", args.compile)) if on)
    decode_mode = args.decode if args.decode != "auto" else "graph" if run.device.type == "cuda" else "dynamic"
    # the dynamic decode is the plain one (uncompiled, only the filled cache): no flag avoids a fault there
    decode_flag = "" if decode_mode == "dynamic" else "--decode dynamic"
    decode_path = f"the sampler's decode (--decode {decode_mode}{', compiled' if args.compile and decode_flag else ''})"
    fast_lp, plain_lp, fast_grad, plain_grad, fast_teacher, plain_teacher, fast_kl, plain_kl, decode = checks
    for what, value, rounding, flag, slack in (  # slack: the decode's own rounding, one more plain pass's
        (f"{fast_path}: log-probs", fast_lp, plain_lp, fast_flag, 0),
        (f"{fast_path}: the forward KL at the teacher's top-k (the student's gather)", fast_kl, plain_kl, fast_flag, 0),
        (f"{fast_path}: the gradient", fast_grad, plain_grad, fast_flag, 0),
        (f"{decode_path}: its log-probs", decode, plain_lp, decode_flag, plain_lp),
        (f"the teacher's forward ({fast_path}): its log-probs", fast_teacher, plain_teacher, fast_flag, 0),
    ):
        bound = SELF_CHECK_FACTOR * rounding + SELF_CHECK_FLOOR + slack
        if not value <= bound:
            remedy = f"run with {flag} (and report it)" if flag else "report it"
            sys.exit(f"error: self-check: {what} differ from the plain float32 path by {value:.3g} (bound {bound:.3g}, "
                     f"the run's own rounding {rounding:.3g}): that path is wrong on this device; {remedy}, or "
                     "--no-self-check to train anyway")
    taught = "" if run.teacher is None else (
        f"; the teacher's forward {fast_teacher:.2e} (plain {plain_teacher:.2e})" + (
            f", the forward KL {fast_kl:.2e} (plain {plain_kl:.2e})" if args.distill_divergence == "forward" else ""))
    noise = f"; a fresh model's {zero} zero output projections and its head filled with noise for it" if zero else ""
    steps = sorted({end for end in ends if end >= 0})
    ended = f", rows made to end at steps {', '.join(map(str, steps))}" if steps else ""
    run.log(f"self-check: {fast_path} vs the plain float32 path: log-probs {fast_lp:.2e} (plain {plain_lp:.2e}), "
            f"gradient {fast_grad:.2e} (plain {plain_grad:.2e}){taught}; {decode_path} log-probs {decode:.2e}{ended}; "
            f"{len(ends)} rows{noise}; {seconds:.1f}s")


# -----------------------------------------------------------------------------
# The memory plan: what each rank will hold, from the model's shapes (on the meta device) before its checkpoint is read

GiB = 2 ** 30


def memory_plan(model, args, world_size, longest_prompt, dtype, optimizer_state=None, exact_attention=False,
                teacher=None):
    """-> {part: bytes per rank}: what stays all run, then the two phases that follow each other: sampling (one
    --sample-batch-size chunk) and the update. optimizer_state: the largest rank's bytes, when known.
    exact_attention: packed passes take the exact path, not flash attention (the CPU, float32): its block counts."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer_state is None:
        owners = shard_owners(trainable, world_size) if args.shard_optimizer and world_size > 1 else None
        optimizer_state = max(planned_optimizer_state(model, args, owners, world_size))
    c, compute_bytes = model.config, 2 if dtype == "bfloat16" else 4
    length, rows = longest_prompt + args.max_new_tokens, sample_batch_rows(args, world_size)  # rows: a generate call's
    kv_per_row = 2 * c.n_layer * c.n_kv_head * (c.n_embd // c.n_head) * (length + 1) * compute_bytes  # (+ a spare)
    micro_rows = min(args.device_batch_size or 1, args.prompts_per_step // world_size * args.num_samples)
    if args.pack and not args.device_batch_size:
        tokens, passed = args.tokens_per_pass, f"{args.tokens_per_pass} tokens"
    else:  # packed: passes of that many whole rows, each up to the longest
        tokens = micro_rows * (length - 1 if args.pack else length)
        passed = f"{micro_rows} packed rows, {tokens} tokens" if args.pack else f"{micro_rows} rows"
    return {
        "weights (float32)": sum(p.numel() * 4 for p in model.parameters()),
        "optimizer state per rank": optimizer_state,
        "reference model": frozen_bytes(model, (args.ref_dtype or dtype) == "bfloat16")
        if args.kl_coef and not args.lora_rank and not args.ref_offload else 0,
        **({"teacher model": frozen_bytes(teacher, dtype == "bfloat16")} if teacher is not None
           and not args.teacher_offload else {}),
        # autocast keeps a bf16 copy of each weight a matmul reads, forward to backward and through a generate call
        "bf16 copies of the weights (autocast)": 2 * sum(m.weight.numel() for m in model.modules() if isinstance(
            m, torch.nn.Linear)) if compute_bytes == 2 else 0,
        f"sampling: KV cache and logits of {rows} replies": rows * (kv_per_row + c.vocab_size * 4)
        + rows // args.num_samples * kv_per_row,  # + the prompts' own cache, before each sample gets a copy
        "update: gradients (float32)": sum(p.numel() * 4 for p in trainable),
        # Muon's step holds at most 9.25 float32 copies of its largest stack beside the gradients, the activations
        # gone (`python tests/bench_memory.py --muon`): counted as 10
        MUON_STEP: 0 if args.optimizer != "muon" or args.lora_rank else 10 * max(
            len(stack) * stack[0].numel() * 4 for stack in Muon.stacks(model.transformer.h.parameters())),
        f"update: activations of {passed} (estimate)": pass_activations(c, tokens, args),
        **({"update: exact attention's padded rows (bound)": exact_attention_bytes(
            c, args, world_size, length - 1, dtype, args.tokens_per_pass)} if args.pack and exact_attention else {}),
        # --distill-divergence forward: the teacher's top-k ids (int64) and log-probs, and the rest's, at every reply
        # token of the rank's step, taken before the update and kept through it
        **({"update: the teacher's top-k of the step's reply tokens": args.prompts_per_step // world_size
            * args.num_samples * args.max_new_tokens * (12 * min(args.distill_top_k, c.vocab_size) + 4)}
           if teacher is not None and args.distill_divergence == "forward" else {}),
    }


MUON_STEP = "update: Muon's step, stacks of its matrices (bound)"


def frozen_bytes(net, bf16_matrices):
    """Bytes of a model that does not train (frozen): its matrices in bf16 when bf16_matrices, the rest float32."""
    linear = {id(m.weight) for m in net.modules() if isinstance(m, torch.nn.Linear)}
    return sum(p.numel() * (2 if bf16_matrices and id(p) in linear else 4) for p in net.parameters())


def exact_attention_bytes(c, args, world_size, longest_row, dtype, tokens_per_pass):
    """Bytes of packed attention's exact path: q, k, v and output of a [rows, longest row] block kept in every layer.
    Rows a pass: --device-batch-size; else the minibatch's (a compiled forward's shape), or one per token at most."""
    most = minibatch_rows(args, world_size)
    rows = min(args.device_batch_size, most) if args.device_batch_size else most if args.compile else min(
        most, tokens_per_pass)
    head_dim, compute_bytes = c.n_embd // c.n_head, 2 if dtype == "bfloat16" else 4
    return rows * longest_row * c.n_layer * head_dim * (2 * c.n_head + 2 * c.n_kv_head) * compute_bytes


def pass_activations(c, tokens, args):
    """Bytes of one forward and backward pass over this many tokens: ~76 bytes per token, layer and unit of width
    eager, ~48 compiled (inductor keeps fewer intermediates), and the head's chunk of at most HEAD_CHUNK logits at ~24
    bytes an element with the entropies' gradient, 16 without. Measured (bf16 autocast keeps the residual stream and
    norms float32: not Korthikanti et al.'s 34): on an H200 at d20, 75-76 eager, 46.7 compiled (the plan within 4%
    of torch's allocated peak); the head's, 24.0-24.4 and 16.0-16.4 on a CPU (`python tests/bench_memory.py --head`)."""
    head_positions = min(tokens, max(1, HEAD_CHUNK // c.vocab_size))
    head_bytes = 24 if args.entropy_coef > 0 else 16  # the entropies' graph kept only for an entropy bonus
    if args.distill_coef and args.distill_divergence == "forward":  # the teacher's top-k gathered from the student's
        head_bytes += 8  # log-probs, and the rest's log-mass (a masked [N, V] copy): 24.2 measured, 16.2 without
    return tokens * c.n_layer * (48 if args.compile else 76) * c.n_embd + head_positions * c.vocab_size * head_bytes


def size(n):
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2 ** 20:.1f} MiB"


def phase_bytes(plan, phase=None):
    """The plan's bytes of one phase ("sampling", "update"), or with None of what stays all run."""
    return sum(v for k, v in plan.items() if (k.split(":")[0] == phase if phase else ":" not in k))


def plan_peak(plan):
    """What stays, plus the larger of the two phases."""
    return phase_bytes(plan) + max(phase_bytes(plan, "sampling"), phase_bytes(plan, "update"))


def planned_optimizer_state(model, args, owners, world_size):
    """-> each rank's optimizer state bytes, as the optimizers allocate it: built on the meta model, stepped once."""
    optimizers = make_optimizers(model, args)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    per_rank = [0] * world_size
    for opt in optimizers:
        opt.step()
        for p, entry in opt.state.items():
            for rank in [owners[id(p)]] if owners else range(world_size):
                per_rank[rank] += state_bytes(entry)
    for p in params:
        p.grad = None
    return per_rank


def sample_batch_rows(args, world_size):
    """Replies a generate call samples: --sample-batch-size in whole groups, at most this rank's step."""
    rows, G = args.prompts_per_step // world_size * args.num_samples, args.num_samples
    return min(rows, max(G, (args.sample_batch_size or rows) // G * G))


def minibatch_rows(args, world_size):
    """Rows of this rank's share of a minibatch (at most: the shares differ by one where they do not divide)."""
    return -(-args.prompts_per_step // world_size * args.num_samples // args.num_minibatches)


def free_memory(device):
    """Bytes this process may use: the GPU's free memory, or its share of the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return available // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the ranks of a machine share it


def fitted_plan(model, args, world_size, longest_prompt, dtype, free, gpu, teacher=None):
    """-> (the plan, the plan at the smallest chunks: one group a generate call, one row a pass). Unset chunks are
    fitted to 90% of the free memory: --sample-batch-size on a GPU; the rows or tokens a pass, at most the step's."""
    on_cpu = {} if gpu else dict(ref_offload=False, teacher_offload=False)  # off a GPU they stay where they are
    longest_row = longest_prompt + args.max_new_tokens - 1
    exact = not flash_varlen_takes(gpu, getattr(torch, dtype), model.config.n_embd // model.config.n_head)
    smallest = memory_plan(model, SimpleNamespace(**dict(vars(args), **on_cpu, sample_batch_size=args.num_samples,
                                                         device_batch_size=1, tokens_per_pass=longest_row)),
                           world_size, longest_prompt, dtype, exact_attention=exact, teacher=teacher)
    if args.sample_batch_size is None and gpu:
        per_reply = phase_bytes(smallest, "sampling") / args.num_samples
        args.sample_batch_size = max(args.num_samples, int((0.9 * free - phase_bytes(smallest)) // per_reply))
    room = 0.9 * free - phase_bytes(smallest) - smallest["update: gradients (float32)"] - smallest[MUON_STEP]
    rows = args.prompts_per_step // world_size * args.num_samples
    if args.device_batch_size is None and not args.pack:
        per_row = next(v for k, v in smallest.items() if k.startswith("update: activations"))
        args.device_batch_size = max(1, min(rows, int(room // per_row)))
    if args.tokens_per_pass is None and args.pack:  # the most that fit, in 128s (the kernels' tiles)
        fits = [t for t in range(128, rows * longest_row + 128, 128) if pass_activations(model.config, t, args) + (
            exact_attention_bytes(model.config, args, world_size, longest_row, dtype, t) if exact else 0) <= room]
        args.tokens_per_pass = max([longest_row] + fits[-1:])
    return memory_plan(model, SimpleNamespace(**dict(vars(args), **on_cpu)), world_size, longest_prompt, dtype,
                       smallest["optimizer state per rank"], exact, teacher), smallest


def plan_memory(args, world_size, device, dtype, task, log):
    """Print the memory plan (rank 0), fit the chunks left unset, and stop with one line if even the smallest can't."""
    model, tokenizer, _ = load_policy(args, lambda *a: None, shapes_only=True)
    if args.lora_rank:
        model.add_lora(args.lora_rank, args.lora_alpha, args.seed)
    teacher = load_teacher(args, tokenizer, lambda *a: None, shapes_only=True)[0] if args.distill_coef > 0 else None
    longest_prompt = task.longest_prompt(tokenizer)
    free, gpu = free_memory(device), device.type == "cuda"
    for flag, what in (("ref", "reference"), ("teacher", "teacher")):
        if getattr(args, f"{flag}_offload") and not gpu:
            log(f"note: --{flag}-offload keeps the {what} off a GPU; on the CPU it stays where it is")
    plan, smallest = fitted_plan(model, args, world_size, longest_prompt, dtype, free, gpu, teacher)
    rows_flag, per_pass = (("--tokens-per-pass", args.tokens_per_pass) if args.pack and not args.device_batch_size
                           else ("--device-batch-size", args.device_batch_size))
    longest_row = longest_prompt + args.max_new_tokens - 1  # input tokens: the prompt and the reply but its last
    if rows_flag == "--tokens-per-pass" and longest_row > per_pass:  # (rows a pass: any length)
        sys.exit(f"error: --tokens-per-pass {args.tokens_per_pass} is less than the longest row, {longest_row} tokens "
                 f"(a prompt of up to {longest_prompt} and a reply of up to --max-new-tokens {args.max_new_tokens}): "
                 f"raise it to at least {longest_row}, or lower --max-new-tokens")
    if plan_peak(smallest) > free:
        remedies = [remedy for remedy, helps in (("--shard-optimizer", not args.shard_optimizer and world_size > 1),
            ("more GPUs (the optimizer state is split over them)", True), ("--lora-rank 16", not args.lora_rank),
            ("--ref-offload", smallest["reference model"]), ("--teacher-offload", smallest.get("teacher model")),
            ("a smaller --max-new-tokens", True)) if helps]
        sys.exit(f"error: the memory plan needs {size(plan_peak(smallest))} a rank even at one group a generate "
                 f"call and one row a pass, and the {device.type} has {size(free)} free: use {', '.join(remedies)}")
    sharded = f", optimizer state sharded over {world_size} ranks" if world_size > 1 and args.shard_optimizer else ""
    log(f"memory plan per rank ({device.type}, {size(free)} free{sharded}; {rows_flag} {per_pass}; prompts up to "
        f"{longest_prompt} tokens):\n" + "\n".join(f"  {k:56s} {size(v):>10s}" for k, v in plan.items())
        + f"\n  {'peak':56s} {size(plan_peak(plan)):>10s}" if args.show_config else f"memory plan per rank: peak "
        f"{size(plan_peak(plan))} ({device.type}, {size(free)} free{sharded}; --show-config prints its parts)")
    if args.ref_offload and gpu:  # what it saves, and what it costs: one copy to the GPU a step
        kept = frozen_bytes(model, (args.ref_dtype or dtype) == "bfloat16")  # a reference copy: resolve_config checks
        log(f"  --ref-offload: the reference's {size(kept)} wait in CPU memory; their copy to the GPU takes about "
            f"{kept / 25e9:.2f} s a step at 25 GB/s (a PCIe 4.0 x16 link; not measured)")
    if plan_peak(plan) > free:
        log(f"warning: the plan's peak ({size(plan_peak(plan))}) is above the free {size(free)}: lower "
            f"--sample-batch-size or {rows_flag} if the run runs out of memory")
    return longest_prompt


# -----------------------------------------------------------------------------
# The flags: each declared once with its role, the presets, the demo; resolved and checked before any work

def at_least(low):
    """The type of an integer flag with a lower bound: argparse refuses a smaller value, naming the flag."""
    def integer(text):  # not a number: argparse says "invalid integer value", after this function's name
        if int(text) < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {int(text)}")
        return int(text)
    return integer


def weights(text):
    """The type of --reward-weights: "correct=1,format=0.1" -> {"correct": 1.0, "format": 0.1}."""
    try:
        return {name.strip(): float(value) for name, value in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected name=weight,name=weight, got {text!r}") from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help shows a flag's own default where its help does not say it (the algorithm flags' come from --algo)."""

    def _get_help_string(self, action):
        # `is`, not `in`: 0 == False, and a default of 0 is a default to show
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
        text = action.help or ""
        return text + " (default: %(default)s)" if action.option_strings and shown and "default" not in text else text


# A flag's role, besides shaping the weights' trajectory (what --resume refuses to change), declared with it:
#   observes   what is evaluated, saved and logged, and where: --resume may change it
#   step-size  the way on after non-finite weights: --resume may change it (noted, kept in config.json)
#   spread     how the work is spread over processes and memory (the same steps up to rounding): likewise
#   machine    this machine's and process's: an evaluation (--ask, --eval-only) never reads it from the run
#   teacher    the teacher's, which an evaluation never reads
#   sampling   how replies are sampled: an evaluation may change it
#   evaluated  what an evaluation of a run's checkpoint reads from its config.json where no flag says otherwise
#   unrecorded what the command does with a run, not what the run is: not in config.json
#   episode    how an episode is played: an evaluation may change it (more retries than the run trained with)
# idle: [(when, why)]: given while one holds, the flag does nothing; a note at start says why (the first that holds),
# since a flag silently idle looks like a setting that was tried.
ROLES, IDLE = {}, {}
ROLE_NAMES = {"observes", "step-size", "spread", "machine", "teacher", "sampling", "evaluated", "unrecorded", "episode"}


def declare(group):
    """-> the group's add_argument, taking each flag's role and idle conditions too."""
    def arg(*names, role="", idle=(), **kwargs):
        assert set(role.split()) <= ROLE_NAMES, f"{names[0]}: role {role!r}"  # a typo: silently a trajectory flag
        dest = group.add_argument(*names, **kwargs).dest
        ROLES[dest], IDLE[dest] = role.split(), idle
    return arg


def flags_with(role):
    return tuple(dest for dest, roles in ROLES.items() if role in roles)


NO_KL = (lambda a: not a.kl_coef, "the KL's weight is 0 (--kl-coef)")
SAPO_ONLY = (lambda a: a.policy_loss != "sapo", "it is SAPO's, and the policy loss is another")
GATE_AT_ONE = (lambda a: a.policy_loss == "sapo" and a.ppo_epochs == a.num_minibatches == 1, "with one optimizer "
               "step a sampled batch the ratio is 1: there SAPO's gate is the policy gradient at any temperature")
NO_CLIP = (lambda a: a.policy_loss == "sapo", "SAPO's smooth gate has no clip (--sapo-tau-pos, --sapo-tau-neg)")
RATIO_ONE = (lambda a: a.policy_loss != "sapo" and a.ppo_epochs == a.num_minibatches == 1, "with one optimizer step a "
             "sampled batch (--ppo-epochs 1, --num-minibatches 1), pi_theta is pi_old at that step: the ratio is 1, "
             "inside any clip")
NO_LORA = (lambda a: not a.lora_rank, "no adapters without --lora-rank")
NOT_MUON = (lambda a: a.lora_rank or a.optimizer == "adamw", "it is --optimizer muon's (adamw: --lr; LoRA: --lora-lr)")
ONE_TURN = (lambda a: a.attempts == 1 and (a.task in ("gsm8k", "sort") or a.task.endswith(".jsonl")),
            "the task answers no turn (a built-in or .jsonl task, --attempts 1): its episodes are one reply")
NO_EVALS = (lambda a: not a.eval_every and not (a.eval_only or a.ask), "--eval-every 0: no evals")
ASK_ONE = (lambda a: a.ask, "--ask answers one question")


parser = argparse.ArgumentParser(prog="grpo.py", description="GRPO / REINFORCE on GSM8K or a toy task, in one file. "
                                 "The defaults shown are a GSM8K run's; python grpo.py --demo --help shows the demo's.",
                                 usage="python grpo.py [flags]   (python grpo.py --help lists them)",
                                 formatter_class=HelpFormatter, allow_abbrev=False)
algorithm = parser.add_argument_group("algorithm")
arg = declare(algorithm)
arg("--algo", default="reinforce", help="algorithm preset: sets the flags of this group that are not given",
    choices=["reinforce", "rloo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "distill"])
arg("--advantage", choices=["mean", "zscore", "rloo", "batch", "none"], help="r - mean(r); z-scored in the group; "
    "leave-one-out baseline; / the std of the step's rewards; none: 0 (the reward teaches nothing: --algo distill)",
    idle=[(lambda a: a.reward_combination == "normalize-then-sum", "--reward-combination normalize-then-sum z-scores "
           "each reward term in its group whatever it says")])
arg("--aggregation", choices=["nanochat", "token", "sequence", "constant"], help="per-token losses: nanochat's RL loss "
    "(a question's replies in passes of --pass-size, each pass's sum / its tokens, the mean over passes and "
    "questions); averaged over all tokens; per reply, then over replies; / (replies x --max-new-tokens)")
arg("--pass-size", type=at_least(1), help="--aggregation nanochat: replies per pass (nanochat's --device-batch-size, "
    "whose default is 8); unlike --device-batch-size here, part of the objective")
arg("--ppo-epochs", type=at_least(1), help="passes over each sampled batch (mu in the GRPO paper)")
arg("--num-minibatches", type=at_least(1), help="optimizer steps per pass over the sampled batch")
arg("--ratio-level", choices=["token", "sequence"], help="one ratio per token (PPO, GRPO) or per reply (GSPO)")
arg("--policy-loss", choices=["clip", "cispo", "sapo"], help="PPO's clipped ratio x A; CISPO's -sg(clip(rho)) A log pi "
    "(the weight clipped, every token keeps a gradient); SAPO's smooth gate -(4 / tau) sigmoid(tau (rho - 1)) A")
arg("--sapo-tau-pos", type=float, idle=[SAPO_ONLY, GATE_AT_ONE], help="SAPO's gate temperature where A > 0")
arg("--sapo-tau-neg", type=float, idle=[SAPO_ONLY, GATE_AT_ONE], help="the same where A < 0 (larger: faster decay)")
arg("--clip-eps", type=float, idle=[NO_CLIP, RATIO_ONE], help="lower ratio clip: rho >= 1 - eps (cispo: the weight's)")
arg("--clip-eps-high", type=float, help="upper ratio clip: rho <= 1 + eps (cispo: the weight's; default: --clip-eps)",
    idle=[NO_CLIP, RATIO_ONE])
arg("--clip-ratio-c", type=float, idle=[RATIO_ONE], help="dual clip: with A < 0 the loss is <= -C * A (default: off)")
arg("--kl-coef", type=float, help="beta, the KL penalty's weight; 0 builds no reference model")
arg("--kl-estimator", choices=["k1", "k2", "k3"], help="per-token KL estimator in the loss (docs/algorithm.md: which "
    "KL's gradient each gives)", idle=[NO_KL, (lambda a: a.kl_placement == "reward", "the reward's KL is each "
                                               "reply's summed k1 (--kl-placement reward); the logged kl uses it")])
arg("--kl-placement", default="loss", choices=["loss", "reward"], help="beta x KL in the loss (DeepSeekMath), or beta "
    "x each reply's summed k1 taken from its reward before the advantages; there an all-equal group's advantages are "
    "its replies' KL differences: beta-sized (mean, rloo), / the step's std (batch), unit std (zscore)", idle=[NO_KL])
arg("--ref-dtype", choices=["float32", "bfloat16"], help="reference matrices (default: the compute dtype; bfloat16 "
    "needs --dtype bfloat16)", idle=[(lambda a: not a.kl_coef, "no reference model without a KL term (--kl-coef)")])
arg("--ref-offload", action="store_true", role="spread",
    help="keep the reference model in (pinned) CPU memory, on the GPU only for its log-probs once a step",
    idle=[(lambda a: not on_gpu(a), "it moves the reference off a GPU, and the run is on the CPU")])
arg("--ref-reset-every", type=at_least(0), help="steps between copies of the policy into the reference (0: never)")
arg("--distill-coef", type=float, help="on-policy distillation's weight lambda (needs --teacher): with "
    "--distill-divergence sampled each sampled token's advantage gains lambda x (log pi_teacher - log pi_old); with "
    "forward the loss gains lambda x KL(pi_teacher || pi_theta) at each position")
arg("--distill-divergence", choices=["sampled", "forward"], help="--distill-coef's term: sampled: the teacher's "
    "log-ratio of each sampled token as its advantage (the reverse KL, one sample a position); "
    "forward: KL(pi_teacher || pi_theta) at each position over the teacher's --distill-top-k tokens and one bucket "
    "for the rest, a loss term", idle=[(lambda a: not a.distill_coef, "no teacher term (--distill-coef)")])
arg("--distill-top-k", type=at_least(1), default=64, help="forward KL: the teacher's tokens a position (all for a "
    "smaller vocabulary)", idle=[(lambda a: a.distill_divergence != "forward", "it is --distill-divergence forward's")])
arg("--teacher", metavar="DIR", help="the frozen teacher of --distill-coef: a nanochat checkpoint folder, or a run "
    "folder of this program, of any generation and depth, with the policy's tokenizer", role="teacher")
arg("--teacher-step", type=at_least(0), help="--teacher: its checkpoint step (default: the largest)", role="teacher",
    idle=[(lambda a: not a.teacher, "it picks --teacher's checkpoint")])
arg("--teacher-offload", action="store_true", role="teacher", idle=[(lambda a: not a.teacher, "no teacher (--teacher)"),
    (lambda a: not on_gpu(a), "it moves the teacher off a GPU, and the run is on the CPU")],
    help="keep the teacher in (pinned) CPU memory, on the GPU only for its log-probs once a step")
arg("--drop-equal-groups", action=argparse.BooleanOptionalAction, help="leave all-equal groups out of the loss")
arg("--mask-truncated", action=argparse.BooleanOptionalAction, help="leave cut-off replies out of the loss")
arg("--dynamic-sampling", action=argparse.BooleanOptionalAction, help="DAPO: resample until groups' rewards differ")
arg("--max-sampling-rounds", type=at_least(1), default=4, help="--dynamic-sampling: sampling rounds per step at most",
    idle=[(lambda a: not a.dynamic_sampling, "it bounds --dynamic-sampling, which is off")])
arg("--overlong-buffer", type=at_least(0),
    help="DAPO: penalise replies in their last N sampled tokens before the limit")
arg("--entropy-coef", type=float, default=0.0, help="entropy bonus: the loss subtracts this x the entropy (nats)")
arg("--rollout-correction", default="off", choices=["off", "tis", "mask"],
    help="correct for the sampler's own distribution: weight by min(pi_old / pi_sampler, C) or drop outside [1/C, C]")
arg("--rollout-correction-cap", type=float, default=2.0, help="C of --rollout-correction",
    idle=[(lambda a: a.rollout_correction == "off", "the correction is off (--rollout-correction)")])
arg = declare(parser.add_argument_group("sampling (shared by all presets)"))
arg("--prompts-per-step", type=at_least(1), default=16, help="questions per step, across all ranks")
arg("--num-samples", type=int, default=16, help="replies per question (the group size G)", role="sampling evaluated",
    idle=[(lambda a: a.eval_only, "--eval-only samples --pass-k replies a problem")])
arg("--max-new-tokens", type=at_least(1), default=256, help="reply length limit in training, tokens (an episode's: "
    "every token after the prompt, sampled and forced: the environment's turns and a tool's output count too)",
    role="sampling", idle=[(lambda a: a.eval_only or a.ask, "an evaluation's replies are --eval-max-new-tokens long")])
arg("--max-turns", type=at_least(1), default=10, help="an episode's assistant turns at most, for a task that answers "
    "(respond, docs/tasks.md); the environment is not asked after the last", role="evaluated episode", idle=[ONE_TURN])
arg("--max-turn-tokens", type=at_least(1), help="an episode's assistant turn: tokens sampled at most, then its "
    "<|assistant_end|> is forced and the environment answers (default: no cap but --max-new-tokens)",
    role="evaluated episode", idle=[ONE_TURN])
arg("--attempts", type=at_least(1), default=1, help="retries after feedback: a wrong reply is answered 'Your answer is "
    "wrong. Try again (2 attempts left).' until one is right or N attempts are spent (1: one reply)",
    role="evaluated episode")
arg("--temperature", type=float, default=1.0, help="sampling and log-prob temperature", role="sampling evaluated")
arg("--top-k", type=int, default=50, role="sampling evaluated", help="sample from the k likeliest tokens (0: all)")
arg("--sample-batch-size", type=at_least(1), help="replies sampled per generate call, in whole groups: memory only, "
    "the same replies (default: on a GPU as many as its free memory holds, else the rank's whole step)", role="spread")
arg("--reward-weights", type=weights, help="the task's reward terms combined, e.g. correct=1,format=0.1 (default: "
    "its first term alone; gsm8k: correct, format; sort: reward)")
arg("--reward-combination", default="sum", choices=["sum", "normalize-then-sum"], help="several reward terms: "
    "their weighted sum, then the group advantages (--advantage); or each term z-scored in its group, then their "
    "weighted sum divided by its std over the step (GDPO, whatever --advantage says)")
arg = declare(parser.add_argument_group("optimizer (shared by all presets)"))
arg("--optimizer", default="muon", choices=["muon", "adamw"], help="muon: nanochat's Muon + AdamW as its RL script "
    "builds it (groups, learning rates, betas, decays; tested against nanochat's steps); adamw: one AdamW",
    idle=[(lambda a: a.lora_rank, "the adapters train with AdamW at --lora-lr")])
arg("--optimizer-version", choices=["v1", "v2", "v3", "v4", "v5"], idle=[NOT_MUON], help="muon: nanochat's optimizer "
    "version (default: the checkpoint generation's; this program's checkpoint: the one it trained with; scratch: v5)")
arg("--lr", type=float, default=1e-5, help="--optimizer adamw: learning rate", role="step-size",
    idle=[(lambda a: a.lora_rank or a.optimizer == "muon", "it is --optimizer adamw's (muon: --matrix-lr, "
           "--embedding-lr, --unembedding-lr, all times --init-lr-frac; LoRA: --lora-lr)")])
for flag, default, what in (("--matrix-lr", 0.02, "learning rate of the block matrices"),
                            ("--embedding-lr", 0.2, "AdamW learning rate of the embedding"),
                            ("--unembedding-lr", 0.004, "AdamW learning rate of the lm head"),
                            ("--init-lr-frac", 0.05, "every learning rate is scaled by this")):
    arg(flag, type=float, default=default, help=f"muon: {what}", role="step-size", idle=[NOT_MUON])
arg("--weight-decay", type=float, default=0.0, help="decoupled weight decay (muon: on AdamW in v1, as cautious decay "
    "on Muon from v2, as nanochat's RL script passes it)")
arg("--grad-clip", type=float, default=0.0, help="clip the gradient's global norm to this (0: off)", role="step-size")
arg("--lr-schedule", default="linear", choices=["linear", "cosine", "constant"], help="after warmup, to --min-lr-frac")
arg("--warmup-steps", type=at_least(0), default=0, help="steps of linear warmup from 1/N of the learning rates")
arg("--min-lr-frac", type=float, default=0.0, help="the schedule's floor, a fraction of the learning rates",
    idle=[(lambda a: a.lr_schedule == "constant", "--lr-schedule constant never decays")])
arg("--num-steps", type=at_least(1), help="training steps (default: the task's; gsm8k: one epoch of its train split)")
arg("--lora-rank", type=at_least(0), default=0,
    help="train rank-r LoRA adapters on the block matrices, everything else frozen (0: full fine-tuning)")
arg("--lora-alpha", type=float, help="adapter output scaled by alpha / r (default: 2r, a scale of 2)", idle=[NO_LORA])
arg("--lora-lr", type=float, default=1e-4, help="AdamW learning rate of the adapters (--optimizer does not apply)",
    role="step-size", idle=[NO_LORA])
arg = declare(parser.add_argument_group("task, model and checkpoints"))
arg("--demo", action="store_true", help="CPU demo defaults: sort task, 2-layer model from scratch, full GRPO")
arg("--task", default="gsm8k", help="what to train on: gsm8k, sort, a .jsonl file of problems, or your own task "
    "class as module:Class or path/to/file.py:Class (docs/tasks.md)", role="evaluated")
arg("--task-test", role="evaluated", help="--task FILE.jsonl: test problems (default: every 10th problem of the file)")
arg("--grader", default="number", help="--task FILE.jsonl: how a reply is graded where a line names no grader: "
    "number (after ####, else the last), exact (the whole reply), choice (the letter of a choice), or your function "
    "as path/to/file.py:fn, fn(question, reply, answer) -> the reward (correct at 1 or more), (reward, format), or "
    "{reward, correct, format} (docs/tasks.md)", role="evaluated",
    idle=[(lambda a: not any(spec.endswith(".jsonl") for spec in [a.task] + a.eval_task), "it grades .jsonl tasks")])
arg("--calculator", action=argparse.BooleanOptionalAction, default=False,
    help="--task FILE.jsonl: the sampler runs the calculator tool, as for GSM8K", role="evaluated",
    idle=[(lambda a: not a.task.endswith(".jsonl"), "it is for --task FILE.jsonl (gsm8k's is always on)")])
arg("--eval-task", action="append", metavar="TASK", help="also evaluate this task's test problems at every eval, "
    "logged as eval_<name>_<metric> (repeatable; any --task value)", role="observes evaluated", idle=[NO_EVALS])
arg("--gsm8k-dir", role="evaluated", help="folder of {train,test}.jsonl (default: $NANOGRPO_GSM8K_DIR, cache, "
    "download)", idle=[(lambda a: "gsm8k" not in [a.task] + a.eval_task, "no task is gsm8k (--task, --eval-task)")])
arg("--sort-length", type=at_least(1), default=5, help="digits per sort problem", role="evaluated",
    idle=[(lambda a: "sort" not in [a.task] + a.eval_task, "no task is sort (--task, --eval-task)")])
arg("--init", default="sft", help="'sft': newest nanochat chat SFT checkpoint, 'scratch', a checkpoint folder, or a "
    "run folder of this program")
arg("--init-step", type=at_least(0), help="checkpoint step to start from (default: the largest)",
    idle=[(lambda a: a.init == "scratch", "--init scratch reads no checkpoint")])
arg("--model-tag", help="nanochat model tag, e.g. d20 (default: the largest d<N>)",
    idle=[(lambda a: a.init != "sft", "it picks --init sft's checkpoint")])
arg("--generation", choices=list(GENERATIONS), help="nanochat GPT generation (default: from its files)")
arg("--window-pattern", help="S/L per layer where the checkpoint's config has none (default: L)")
arg("--depth", type=int, default=4, help="scratch model: layers")
arg("--n-embd", type=int, default=256, help="scratch model: width")
arg("--n-head", type=int, default=2, help="scratch model: attention heads (and KV heads)")
arg = declare(parser.add_argument_group("run, evaluation and logging"))
arg("--run-name", role="observes machine", help="files go to <runs-dir>/<run-name> (default: <task>-<algo>-seed<seed>)")
arg("--runs-dir", default="runs", help="folder of the run folders", role="observes machine")
arg("--resume", action="store_true", help="continue the run from its latest checkpoint", role="unrecorded")
arg("--seed", type=int, default=0, help="seeds a scratch model's weights, the sampling, and the order of every "
    "epoch but the first (which takes the task's fixed order, so that every seed sees the same questions at the same "
    "step and seeds differ in their sampling alone; GSM8K's: shuffled once, as nanochat's)", role="sampling evaluated")
arg("--eval-every", type=at_least(0), default=60,
    help="steps between evals, and one at the start and the end (0: no evals)", role="observes")
arg("--eval-examples", type=int, default=400, help="test problems per periodic eval",
    role="observes evaluated", idle=[NO_EVALS, ASK_ONE])
arg("--final-eval-examples", type=int, default=-1, help="test problems in the final eval (-1: all)",
    role="observes evaluated", idle=[NO_EVALS, ASK_ONE])
arg("--eval-only", action="store_true", help="evaluate the start policy on --final-eval-examples problems (or "
    "--eval-examples, given alone), then exit; with --resume the run's newest checkpoint, written to the run's "
    "eval_only.jsonl and evals/eval_only_step_N.jsonl only. A checkpoint of this program is evaluated on its run's "
    "task and sampling settings (its config.json), but for the flags given", role="unrecorded")
arg("--ask", metavar="QUESTION", help="print the start policy's replies to this question (greedy, and --num-samples "
    "sampled), graded if it is a task problem, then exit; writes nothing; reads a run's settings as --eval-only does",
    role="unrecorded")
arg("--pass-k", type=at_least(0), default=8, help="samples per problem for pass@1..k in evals (0: greedy only)",
    role="observes evaluated", idle=[NO_EVALS, (lambda a: a.ask, "--ask samples --num-samples replies")])
arg("--eval-max-new-tokens", type=at_least(1), default=512, help="reply length limit in evals, tokens (chat_eval: "
    "512)", role="observes evaluated", idle=[NO_EVALS])
arg("--log-samples", type=at_least(0), default=4, role="observes", help="replies per step in samples.jsonl (0: none)")
arg("--plot", action=argparse.BooleanOptionalAction, default=True, role="observes", help="draw the curves "
    "(matplotlib): curves.png at a run's end, --compare's plot; --no-plot: the tables alone (a sweep's runs, plotted "
    "together later with --compare)", idle=[(lambda a: (a.eval_only or a.ask) and not a.compare,
                                              "an evaluation draws no curves")])
arg("--show-config", action="store_true", role="unrecorded", help="print every setting and each part of the memory "
    "plan at start (default: the flags given and the plan's peak; config.json holds every setting)")
arg("--save-every", type=at_least(0), default=60, help="steps between checkpoints, and one at the end", role="observes")
arg("--keep-states", type=at_least(0), default=2, help="training states kept, newest first (0: all); models all stay",
    role="observes")
arg("--save-on-stop", action=argparse.BooleanOptionalAction, default=True, help="a stop signal (Ctrl-C, a scheduler's "
    "SIGTERM) during the steps saves a checkpoint at the end of the step under way, then stops; a second one stops "
    "at once", role="observes")
arg("--max-bad-steps", type=at_least(1), default=3, role="observes", help="stop after N non-finite losses in a row")
arg("--wandb", metavar="PROJECT", help="also log to this wandb project", role="unrecorded")
arg("--compare", nargs="+", metavar="RUN_DIR", help="table and plot of these runs, then exit (the plot: compare.png "
    "beside the runs when they are in one folder, else in the current one; or --compare-out)", role="unrecorded")
arg("--compare-out", metavar="PNG", idle=[(lambda a: not a.compare, "it is --compare's")], help="--compare's plot file",
    role="unrecorded")
arg = declare(parser.add_argument_group("devices and processes"))
arg("--device", help="cpu, cuda or cuda:<index> (default: cuda if available; several processes on a machine: "
    "cuda, each taking GPU LOCAL_RANK)", role="machine")
arg("--dtype", choices=["float32", "bfloat16"], help="autocast dtype (default: bfloat16 on cuda)", role="machine")
arg("--pack", action=argparse.BooleanOptionalAction, default=True, help="pack each forward/backward pass's rows into "
    "one sequence of real tokens (attention never crosses a row); --no-pack: rows right-padded to the pass's longest",
    role="spread")
arg("--tokens-per-pass", type=at_least(1), role="spread", help="--pack: tokens a forward/backward pass, rows packed "
    "first-fit: memory, not the result (default: on a GPU as many as its free memory holds beside the rest, else 4096)")
arg("--device-batch-size", type=at_least(1), help="rows per forward/backward pass, question by question: "
    "memory, not the result (--pack: only when given, else passes are filled by tokens; --no-pack default: on a GPU "
    "as many as its free memory holds beside the rest, else 8)", role="spread")
arg("--compile", action=argparse.BooleanOptionalAction, role="spread",
    help="torch.compile the forwards, the update and the decode step (default: on with CUDA)")
arg("--threads", type=at_least(1), help="CPU threads of a CPU run, fixed for the run (default: OMP_NUM_THREADS if "
    "set, else one per rank with several processes, else one per core)", role="spread",
    idle=[(lambda a: on_gpu(a), "it sets a CPU run's threads, and the work is on the GPU")])
arg("--decode", default="auto", choices=["auto", "dynamic", "static", "graph"], help="how the sampler's decode "
    "step runs (model.generate): auto is a captured CUDA graph on a GPU, dynamic shapes on the CPU", role="spread")
arg("--self-check", action=argparse.BooleanOptionalAction, help="before the first step, compare the "
    "fast paths (packed/flash attention, compiled forward, captured decode as rows finish, a teacher's forward and "
    "top-k) with the plain one on a few real rows, and stop if they differ beyond rounding (default: on with CUDA)",
    role="observes machine")
arg("--dist-timeout", type=at_least(1), default=600, help="seconds a rank waits for the others before the run stops",
    role="observes machine", idle=[(lambda a: launched()[1] == 1, "there is one process")])
arg("--shard-optimizer", action=argparse.BooleanOptionalAction, help="several processes: each rank keeps and "
    "updates the optimizer state of its share of the weights, the others get the new weights from it (default: on "
    "with several processes)", role="spread", idle=[(lambda a: launched()[1] == 1, "one process holds every weight")])

PRESETS = {  # only the algorithm flags; everything else is shared, so a comparison changes only the algorithm
    # nanochat's simplified REINFORCE: on-policy, r - mean(r), its per-pass token mean, no ratio in effect, no KL
    "reinforce": dict(advantage="mean", aggregation="nanochat", ratio_level="token", policy_loss="clip",
                      ppo_epochs=1, num_minibatches=1, clip_eps=0.2, clip_eps_high=None, sapo_tau_pos=1.0,
                      sapo_tau_neg=1.05, kl_coef=0.0, kl_estimator="k3", ref_reset_every=0, drop_equal_groups=False,
                      mask_truncated=False, dynamic_sampling=False, distill_coef=0.0, distill_divergence="sampled"),
}
# DeepSeekMath: z-scored advantages, per-sequence mean, clipped ratios over 2 epochs, k3 KL to a frozen ref
PRESETS["grpo"] = dict(PRESETS["reinforce"], advantage="zscore", aggregation="sequence", ppo_epochs=2, kl_coef=0.04)
PRESETS["rloo"] = dict(PRESETS["reinforce"], advantage="rloo")  # RLOO (Ahmadian et al. 2024): leave-one-out
PRESETS["dr_grpo"] = dict(PRESETS["grpo"], advantage="mean", aggregation="constant", kl_coef=0.0)  # no length/std bias
PRESETS["dapo"] = dict(PRESETS["grpo"], aggregation="token", clip_eps_high=0.28, kl_coef=0.0,  # DAPO: clip-higher
                       drop_equal_groups=True, mask_truncated=True, dynamic_sampling=True)  # overlong filtering
PRESETS["gspo"] = dict(PRESETS["grpo"], ratio_level="sequence", ppo_epochs=1, num_minibatches=4, clip_eps=3e-4,
                       clip_eps_high=4e-4, kl_coef=0.0)  # GSPO: one ratio per reply, clipped to a very narrow range
PRESETS["cispo"] = dict(PRESETS["grpo"], policy_loss="cispo", aggregation="token", clip_eps=1.0, clip_eps_high=0.28,
                        kl_coef=0.0)  # CISPO (MiniMax-M1): no lower bound, a cap of 1.28 (why: docs/algorithm.md)
PRESETS["sapo"] = dict(PRESETS["grpo"], policy_loss="sapo", kl_coef=0.0)  # SAPO (Qwen): the paper's per-reply mean
# On-policy distillation (GKD, Agarwal et al. 2023): the teacher's distribution is the whole signal (docs/demo.md)
PRESETS["distill"] = dict(PRESETS["reinforce"], advantage="none", aggregation="token", distill_coef=1.0,
                          distill_divergence="forward", ppo_epochs=2)


def as_flags(settings):
    """{"kl_coef": 0.04, "mask_truncated": True} -> "--kl-coef 0.04 --mask-truncated" (None: the flag's default; a
    list's items, a dict of weights as name=weight,name=weight)"""
    shown = {k: ",".join(f"{n}={w:g}" for n, w in v.items()) if isinstance(v, dict) else " ".join(map(str, v))
             if isinstance(v, list) else v for k, v in settings.items()}
    return " ".join(("--no-" if v is False else "--") + k.replace("_", "-") + ("" if isinstance(v, bool) else f" {v}")
                    for k, v in shown.items() if v is not None and v != "")


algorithm.description = "--algo sets, where not given (the others: reinforce's values but these):\n" + "\n".join(
    textwrap.fill(as_flags({k: v for k, v in preset.items() if name == "reinforce" or v != PRESETS["reinforce"][k]}),
                  width=110, initial_indent=f"  {name:10s}", subsequent_indent=" " * 12, break_on_hyphens=False)
    for name, preset in PRESETS.items())
# The demo: a 2-layer GPT from random weights, settings chosen by measurement (docs/demo.md). Full GRPO: from a random
# start reinforce collapses onto one answer before it reads the prompt. The entropy bonus keeps every digit in play; it
# competes with the policy term, whose scale is the advantages': 0.03 with z-scored ones (std 1 in a group), 0.01 with
# raw r - mean (std ~0.1-0.3 here; at 0.03 reinforce stalled at 0.22, its entropy held up over its reward).
DEMO_ENTROPY_COEF = {"zscore": 0.03, "batch": 0.03, "mean": 0.01, "rloo": 0.01,  # batch: / the step's std
                     "none": 0.0}  # distillation: the teacher's log-ratios already push every token its own way
DEMO = dict(task="sort", init="scratch", depth=2, n_embd=64, n_head=4, prompts_per_step=32, num_samples=8,
            max_new_tokens=8, eval_max_new_tokens=8, top_k=0, algo="grpo", optimizer="muon",
            init_lr_frac=0.25, entropy_coef=None, num_steps=1000, eval_every=100, eval_examples=256, pass_k=0,
            save_every=250, device="cpu")


def on_gpu(args):
    return (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")


def evaluated_run(args, given):
    """--ask/--eval-only of this program's checkpoint (--resume, or --init naming its run or checkpoints): flags not
    given take its run's config.json values ("evaluated" ones; with --resume, all but "spread" and "machine") ->
    (the config.json, {flag: (the run's, given)} where they differ)."""
    if not (args.ask or args.eval_only) or (args.init in ("sft", "scratch") and not args.resume):
        return None
    if args.resume:
        run_dir = os.path.join(args.runs_dir, args.run_name)
    else:  # <run>/chatrl_checkpoints/<tag>, or the run folder itself
        folder = checkpoint_folder(args.init)
        beside = os.path.basename(os.path.dirname(os.path.abspath(folder))) == "chatrl_checkpoints"
        run_dir = os.path.normpath(os.path.join(folder, os.pardir, os.pardir)) if beside else args.init
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):  # (--resume says so itself, once it looks for the checkpoint)
        return None
    try:
        run_config = read_config(path)
    except (OSError, ValueError) as e:
        if args.resume:  # resume() names the file and the way on
            return None
        sys.exit(f"error: --init: cannot read the settings of the checkpoint's run from {path} ({e}): restore that "
                 "file, or give the task and sampling flags and copy the checkpoint folder out of the run")
    for k in [k for k in run_config if k in vars(args) and k not in given and (
            k in flags_with("evaluated") or args.resume and k not in flags_with("spread") + flags_with("machine"))]:
        setattr(args, k, run_config[k])
    return path, {k: (run_config[k], getattr(args, k)) for k in flags_with("evaluated")
                  if k in given and k in run_config and run_config[k] != getattr(args, k)}


def resolve_config(argv=None):
    """Parse flags, apply --demo and --algo defaults (explicit flags win), note, check them; exit 2 on bad flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    demo = DEMO if "--demo" in argv else {}  # the demo's defaults, under any flag given explicitly
    defaults = {k: parser.get_default(k) for k in demo}
    parser.set_defaults(**demo)
    try:
        args = parser.parse_args(argv)
    finally:  # also when a bad flag exits: later parses in this process get the usual defaults
        parser.set_defaults(**defaults)
    args.given = list(dict.fromkeys(a.dest for word in argv for a in parser._actions for flag in a.option_strings
                                    if word == flag or word.startswith(flag + "=")))  # in order: start_run says them
    given = set(args.given)
    if args.run_name is None:
        task = task_name(args.task)  # in the name, so that a run on another task never meets this one's folder
        prefix = "demo" if args.demo and task == DEMO["task"] else f"demo-{task}" if args.demo else task
        retries = f"-attempts{args.attempts}" if args.attempts > 1 else ""  # another trajectory, another folder
        args.run_name = f"{prefix}{retries}-{args.algo}-seed{args.seed}"
    args.run_settings = evaluated_run(args, given)
    demo_bonus = apply_preset(args)
    try:  # a task file or module that is not there, or not a task: one line, before any work
        task = task_class(args.task)
        for spec in args.eval_task or []:
            task_class(spec, "--eval-task")
        if args.num_steps is None:
            args.num_steps = default_num_steps(args.task, args)
    except (OSError, ValueError, GraderError) as e:
        sys.exit(f"error: {e}")
    args.eval_task = args.eval_task or []
    args.notes = [f"--{dest.replace('_', '-')} does nothing here: {why[0]}" for dest, idle in IDLE.items()
                  if dest in given for why in [[why for holds, why in idle if holds(args)]] if why]
    if args.eval_only and "eval_examples" in given:  # the count one reaches for first; --eval-only's is the final's
        if "final_eval_examples" in given:
            args.notes.append("--eval-examples does nothing here: --eval-only evaluates --final-eval-examples problems")
        else:
            args.final_eval_examples = args.eval_examples
    # the filters a preset sets for the reward's sake would throw a teacher's signal away; given explicitly, they stay
    filters = [f for f in ("drop_equal_groups", "mask_truncated") if args.distill_coef and f not in given
               and PRESETS[args.algo][f]]
    if filters:
        vars(args).update(dict.fromkeys(filters, False))
        args.notes.append(f"--algo {args.algo}'s {' and '.join('--' + f.replace('_', '-') for f in filters)} "
                          "stay off with a teacher: it scores every token, of equal groups and cut-off replies too "
                          "(give the flag to keep it)")
    own = DEMO_ENTROPY_COEF[PRESETS[args.algo]["advantage"]]  # the bonus of the preset's own advantages
    if demo_bonus and args.entropy_coef != own:  # a rung of the ladder that moves it says so
        moved_by = ("--reward-combination normalize-then-sum" if args.reward_combination == "normalize-then-sum"
                    else f"--advantage {args.advantage}")
        args.notes.append(f"{moved_by} also sets the demo's entropy bonus to {args.entropy_coef:g}, not --algo "
                          f"{args.algo}'s {own:g} (the bonus follows the advantages' scale): --entropy-coef {own:g} "
                          "keeps it")
    fill_unset(args, dict(reward_weights={task.reward_terms[0]: 1.0}, lora_alpha=2.0 * args.lora_rank,
                          shard_optimizer=launched()[1] > 1))
    if not on_gpu(args):  # on a GPU the memory plan fits them (fitted_plan); packed passes have rows only when asked
        fill_unset(args, dict(tokens_per_pass=4096) if args.pack else dict(device_batch_size=8))
    check_config(args)
    return args


def fill_unset(args, values):
    """Set each flag that is still None (neither given nor set yet) to its value here."""
    for key, value in values.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def apply_preset(args):
    """--algo's values for the flags not given, and the defaults that follow from other flags -> whether the demo's
    entropy bonus was set (by the advantages' scale: GDPO's are z-scored)."""
    demo_bonus = args.entropy_coef is None
    fill_unset(args, PRESETS[args.algo])
    fill_unset(args, dict(entropy_coef=DEMO_ENTROPY_COEF["zscore" if args.reward_combination == "normalize-then-sum"
                                                         else args.advantage], clip_eps_high=args.clip_eps,
                          pass_size=8 if args.aggregation == "nanochat" else None,  # nanochat RL's default device batch
                          # DAPO's buffer is a fifth of its length limit (4,096 of 20,480 tokens)
                          overlong_buffer=args.max_new_tokens // 5 if args.algo == "dapo" else 0))
    return demo_bonus


def check_config(args):
    """Exit 2 with argparse's usage line and one line naming the first problem, before any work is done."""
    for bad, message in value_problems(args) + combination_problems(args) + setup_problems(args):
        if bad:
            parser.error(message)


def value_problems(args):
    """check_config's checks of one flag's value that its type cannot make -> [(bad, message)]."""
    lrs = ("lr", "matrix_lr", "embedding_lr", "unembedding_lr", "init_lr_frac", "lora_lr")
    not_finite = [f"--{a.dest.replace('_', '-')}" for a in parser._actions if a.type is float  # every float flag
                  and getattr(args, a.dest) is not None and not math.isfinite(getattr(args, a.dest))]
    return [
        (args.top_k < 0, "--top-k must be >= 0"),
        (args.clip_eps <= 0 or args.clip_eps_high <= 0, "--clip-eps and --clip-eps-high must be > 0"),
        (not args.rollout_correction_cap > 1, "--rollout-correction-cap must be > 1"),
        (args.clip_ratio_c is not None and not args.clip_ratio_c > 1,
         "--clip-ratio-c must be > 1: the dual clip bounds ratios above the PPO interval"),
        *[(getattr(args, k) < 0, f"--{k.replace('_', '-')} must be >= 0") for k in ("kl_coef", "distill_coef")],
        (not (args.sapo_tau_pos > 0 and args.sapo_tau_neg > 0), "--sapo-tau-pos and --sapo-tau-neg must be > 0"),
        (args.entropy_coef < 0, "--entropy-coef must be >= 0 (a negative bonus would push the policy to collapse)"),
        (not 0 <= args.min_lr_frac <= 1, "--min-lr-frac must be between 0 and 1"),
        (args.overlong_buffer > args.max_new_tokens, "--overlong-buffer must be between 0 and --max-new-tokens"),
        (not_finite, f"{', '.join(not_finite)} must be finite"),
        (args.temperature < 0.1, f"--temperature {args.temperature} is (near) greedy: the replies of a group would "
         "be (nearly) all the same, with nothing to compare; use >= 0.1"),  # 0.1: a logit lead of 1 is a ratio of e^10
        (args.top_k == 1, "--top-k 1 is greedy sampling: every reply of a group would be the same (use 0 or >= 2)"),
        (min(getattr(args, k) for k in lrs) <= 0,
         "learning rates (--lr, --matrix-lr, --embedding-lr, --unembedding-lr, --init-lr-frac, --lora-lr) must be > 0"),
        (args.weight_decay < 0 or args.grad_clip < 0, "--weight-decay and --grad-clip must be >= 0"),
    ]


def combination_problems(args):
    """check_config's checks of flags that do not go together -> [(bad, message)]."""
    world_size = launched()[1]
    # the flag the user gave: the preset's own coefficient, or --distill-coef
    distilling = ("--algo distill" if args.algo == "distill" and args.distill_coef == PRESETS["distill"]["distill_coef"]
                  else f"--distill-coef {args.distill_coef:g}")
    return [
        (args.attempts > args.max_turns, f"--attempts {args.attempts} needs as many assistant turns an episode: "
         f"raise --max-turns (now {args.max_turns})"),
        (args.grader not in GRADERS and ":" not in args.grader, f"--grader {args.grader!r} is none of "
         f"{', '.join(GRADERS)}, nor a function as path/to/file.py:fn"),
        (args.prompts_per_step % world_size,
         f"--prompts-per-step {args.prompts_per_step} is not divisible by the {world_size} ranks"),
        (args.num_samples < 2 and not args.ask,  # --ask samples this many replies beside its greedy one
         f"--num-samples {args.num_samples}: group-relative advantages need groups of at least 2 replies"),
        (args.distill_coef > 0 and not (args.teacher or args.eval_only or args.ask), f"{distilling} needs a teacher: "
         "--teacher DIR (a checkpoint folder of a model with the policy's tokenizer, or a run folder of grpo.py)"),
        (args.teacher and not args.distill_coef > 0, "--teacher is read only with --distill-coef > 0 (--algo distill "
         "sets 1.0)"),
        (args.advantage == "none" and not args.distill_coef > 0 and not args.entropy_coef,
         "--advantage none with --distill-coef 0: nothing would teach the policy (the reward's advantage is off)"),
        (args.advantage == "none" and args.reward_combination != "sum",
         "--advantage none turns the reward's advantage off; --reward-combination normalize-then-sum would make one"),
        (args.distill_coef > 0 and args.ratio_level == "sequence", "--distill-coef gives each token its own "
         "advantage, and --ratio-level sequence (GSPO) one ratio a reply: use --ratio-level token"),
        (args.policy_loss != "clip" and (args.ratio_level == "sequence" or args.clip_ratio_c is not None),
         f"--policy-loss {args.policy_loss} is per token: --ratio-level sequence and --clip-ratio-c are PPO-clip's"),
        (args.reward_combination != "sum" and args.kl_placement == "reward" and args.kl_coef > 0,
         "--reward-combination normalize-then-sum and --kl-placement reward: the KL would need a term of its own; "
         "use one of them"),
        (args.ratio_level == "sequence" and args.aggregation != "sequence",
         f"--ratio-level sequence with --aggregation {args.aggregation}: a reply's one ratio (and loss) would count "
         "once per token, weighting replies by their length; use --aggregation sequence (GSPO's)"),
        (args.pass_size is not None and args.aggregation != "nanochat",
         f"--pass-size sets the passes of --aggregation nanochat; --aggregation {args.aggregation} has none"),
        (not set(args.reward_weights) <= set(task_class(args.task).reward_terms) or not all(
            map(math.isfinite, args.reward_weights.values())), f"--reward-weights: the {args.task} task's terms are "
         f"{', '.join(task_class(args.task).reward_terms)}, each with a finite weight (got {args.reward_weights})"),
        (args.task_test is not None and not args.task.endswith(".jsonl"),
         "--task-test names the test file of a --task FILE.jsonl"),
        (len({task_name(spec) for spec in args.eval_task}) < len(args.eval_task) or task_name(args.task) in map(
            task_name, args.eval_task), "--eval-task: each watched task needs a name of its own (a file's stem, a "
         "class's name), other than the trained task's"),
        (args.num_steps is not None and args.warmup_steps >= args.num_steps,
         f"--warmup-steps {args.warmup_steps} leaves no step of the schedule (--num-steps {args.num_steps})"),
        (args.ref_reset_every and not args.kl_coef, "--ref-reset-every needs a reference model: set --kl-coef > 0"),
        (args.num_minibatches > args.prompts_per_step // world_size * args.num_samples,
         "--num-minibatches is larger than the number of replies per rank"),
    ]


def setup_problems(args):
    """check_config's checks of the start model, adapters, device, run folder and evals -> [(bad, message)]."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", launched()[1]))  # the job's processes on this machine
    return [
        (args.depth < 1 or args.n_head < 1 or args.n_embd < 1 or args.n_embd % args.n_head
         or (args.n_embd // max(1, args.n_head)) % 2,
         f"scratch model: --depth, --n-head >= 1 and --n-embd a multiple of --n-head with an even head size "
         f"(got --depth {args.depth} --n-embd {args.n_embd} --n-head {args.n_head})"),
        (args.run_name in ("", ".", "..") or os.sep in args.run_name or (os.altsep or os.sep) in args.run_name,
         f"--run-name {args.run_name!r} must be a plain folder name inside --runs-dir"),
        (args.device is not None and not re.fullmatch(r"cpu|cuda(:(0|[1-9]\d*))?", args.device),
         f"--device {args.device!r}: nanogrpo runs on cpu, cuda or cuda:<index>"),
        (args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available(),
         f"--device {args.device}: this machine has no CUDA device (use --device cpu)"),
        (re.fullmatch(r"cuda:\d+", args.device or "") and int(args.device[5:]) >= torch.cuda.device_count(),
         f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0"),
        (re.fullmatch(r"cuda:\d+", args.device or "") and local > 1, f"--device {args.device} names one GPU, and "
         f"each of the {local} processes on this machine takes its own (GPU LOCAL_RANK): pass --device cuda "
         "(CUDA_VISIBLE_DEVICES picks which GPUs they are)"),
        (args.eval_examples < 1 or args.final_eval_examples == 0 or args.final_eval_examples < -1, "--eval-examples "
         "must be >= 1, --final-eval-examples >= 1 or -1 (all): an eval over no problem measures nothing"),
        (args.lora_rank and args.init == "scratch", "--lora-rank adapts a trained model, and --init scratch starts "
         "from random weights: there is nothing to adapt (train all weights, or start from a checkpoint)"),
        (args.lora_rank and args.ref_dtype is not None, "--ref-dtype sets the dtype of a reference copy; with "
         "--lora-rank the reference is the base model itself (adapters off), there is no copy"),
        (args.lora_rank and not args.lora_alpha > 0, "--lora-alpha must be > 0"),
        (args.ref_offload and (args.kl_coef == 0 or args.lora_rank), "--ref-offload moves the reference copy: there is "
         "none without --kl-coef > 0, and with --lora-rank the reference is the model itself"),
        (args.init == "scratch" and (args.generation or args.window_pattern) is not None,
         "--generation and --window-pattern describe a nanochat checkpoint; --init scratch builds a new classic GPT"),
        (args.window_pattern is not None and not re.fullmatch(r"[SL]+", args.window_pattern),
         f"--window-pattern {args.window_pattern!r} must be a string of S (short window) and L (long) per layer"),
        (args.wandb and importlib.util.find_spec("wandb") is None,
         "--wandb needs the wandb package: pip install wandb"),
    ]


# -----------------------------------------------------------------------------
# The run folder: one process at a time, its files, checkpoints and --resume

@contextmanager
def lock_run_dir(run_dir):
    """One process at a time in a run directory (the kernel drops a dead process's flock: a killed run blocks none)."""
    created = not os.path.exists(run_dir)
    try:
        os.makedirs(run_dir, exist_ok=True)
        lock = open(os.path.join(run_dir, ".lock"), "a")
    except OSError as e:
        sys.exit(f"error: cannot write in the run directory {run_dir} ({e.strerror}): pass a writable --runs-dir")
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.exit(f"error: another grpo.py process is running in {run_dir}: wait for it to end, or pass another "
                     "--run-name")
        except OSError as e:  # a file system without locks (some network mounts): train anyway, and say so
            print(f"warning: cannot lock {run_dir} ({e.strerror}): nothing keeps a second process out of this run")
        try:
            yield
        finally:  # a start that failed before writing anything (a bad flag value, a missing run): no folder left
            if created and os.path.isdir(run_dir) and os.listdir(run_dir) == [".lock"]:
                shutil.rmtree(run_dir, ignore_errors=True)


def discard_unstarted(run_dir):
    """A run stopped before its first training step (a user's grader or task failed) holds nothing a retry could use,
    and its folder would refuse the same command: it goes, if it holds only a run's first files. -> whether it went"""
    try:
        started = any("reward" in m for m in read_step_log(os.path.join(run_dir, "metrics.jsonl"), lambda line: None))
    except (OSError, ValueError):
        return False
    first_files = {"config.json", "metrics.jsonl", "samples.jsonl", "tokenizer", "evals", ".lock"}
    if started or not set(os.listdir(run_dir)) <= first_files:  # a checkpoint, or a file of the user's
        return False
    shutil.rmtree(run_dir)
    return True


def write_run_files(args, run):
    """config.json, the tokenizer (the run folder is a nanochat base dir) and metrics.jsonl, on rank 0. A resumed run
    keeps the logs up to its checkpoint (later steps run again) and rewrites config.json (its eval and saving flags
    may have changed); run.start_evaluated: they hold its start step's eval. -> the earlier segments' wall time."""
    if not run.master:
        return 0.0
    resumed = args.resume and run.start_step > 0
    try:
        kept = {path: [m for m in read_step_log(path, run.log) if m["step"] <= run.start_step]
                if resumed and os.path.isfile(path) else [] for path in (run.metrics_path, run.samples_path)}
    except ValueError as e:
        sys.exit(f"error: --resume: {e}")
    evals_dir = os.path.join(run.run_dir, "evals")
    for name in os.listdir(evals_dir) if os.path.isdir(evals_dir) else []:
        if (m := re.fullmatch(r"step_(\d+)\.jsonl", name)) and not (args.resume and int(m[1]) <= run.start_step):
            os.remove(os.path.join(evals_dir, name))  # evals that metrics.jsonl no longer holds run again
    for leftover in glob.glob(os.path.join(glob.escape(run.run_dir), "**", ".tmp_*"), recursive=True):
        os.remove(leftover)  # half-written files of a run killed while saving; what they replace is intact
    atomic_save(run.config, os.path.join(run.run_dir, "config.json"))
    atomic_save(pickle.dumps(run.tokenizer.enc), os.path.join(run.run_dir, "tokenizer", "tokenizer.pkl"))
    for path, rows in kept.items():
        atomic_save("".join(json.dumps(m) + "\n" for m in rows).encode(), path)
    run.start_evaluated = any(m["step"] == run.start_step and "eval_reward" in m for m in kept[run.metrics_path])
    return max((m["wall_time"] for m in kept[run.metrics_path] if "wall_time" in m), default=0.0)


# config.json's "version": new when what flags do or what a run folder holds changes; --resume refuses other ones
VERSION = 2


# The files a run depends on besides its flags, recorded as config.json's "inputs" (sha256) and checked on --resume.
INPUTS = {"train": "train data ({})", "test": "test data ({})", "tokenizer": "tokenizer (tokenizer.pkl of the start "
          "checkpoint)", "code": "task code", "watched": "data of the watched task",
          "teacher": "teacher (--teacher's checkpoint)"}


def resume(args, run):
    """Load the run's latest complete checkpoint into model, reference and optimizers -> its step."""
    checkpoint_dir, config = run.checkpoint_dir, run.config
    saved = complete_steps(checkpoint_dir)
    config_path = os.path.join(run.run_dir, "config.json")
    if not saved and (not os.path.isfile(config_path) or args.eval_only or args.ask):
        sys.exit(f"error: --resume: no checkpoint with training state in {checkpoint_dir}")
    try:
        run_config = read_config(config_path)
    except (OSError, ValueError) as e:
        sys.exit(f"error: --resume: cannot read the run's flags from {config_path} ({e}): restore that file, or start "
                 f"a new run from the checkpoint with --init {checkpoint_dir}")
    differing = resumable(args, run_config, config, checkpoint_dir)
    if not saved:  # the run stopped before its first save: starting over is what resuming would do
        run.log(f"note: --resume: {run.run_dir} has no complete checkpoint (the run stopped before its first save); "
                "starting it over from step 0")
        return 0
    step = saved[-1]
    changes = {k: [run_config.get(k), config[k]] for k in differing}
    history = run_config.get("resumed_with", []) + ([dict(step=step, **changes)] if changes else [])
    if history:  # absent otherwise, so that a resumed run stays one seed of its configuration in --compare
        config["resumed_with"] = history
    if changes and not (args.eval_only or args.ask):  # (an evaluation's spread over memory is its own)
        run.log(f"note: resuming at step {step} with " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items())
                + ": from here on the run differs from one that never stopped (kept in config.json as resumed_with)")
    model_path, state_path = (os.path.join(checkpoint_dir, f"{kind}_{step:06d}.pt") for kind in ("model", "state"))
    try:
        saved_model = load_checkpoint(checkpoint_dir, step, log=lambda line: None)[0]
        try:  # LoRA: the file holds the merged weights, see below
            run.model.load_state_dict(saved_model.state_dict(), strict=run.model.lora is None)
        except RuntimeError as e:  # a model file and its meta of another run
            raise CheckpointFileError(model_path, f"{model_path} is not this run's model "
                                      f"({error_summary(e)})") from None
        # mapped, on the CPU: each rank reads only what it keeps (a sharded optimizer's share), moved to its device
        state = load_tensors(state_path, mmap=True)
        try:  # the state file's weights, optimizer states and reference; another run's: CheckpointFileError
            if missing := master_weight_names(run.model) - set(state["master_weights"]):
                raise KeyError(f"no master weights for {', '.join(sorted(missing)[:3])}")
            # what the file's bf16 embeddings rounded away; with LoRA the base matrices and the adapters
            run.model.load_state_dict(state["master_weights"], strict=False)
            if run.optimizers and len(state["optimizers"]) != len(run.optimizers):  # evaluating: the weights alone
                raise ValueError(f"it holds {len(state['optimizers'])} optimizers, the run has {len(run.optimizers)}")
            for opt, opt_state in zip(run.optimizers, state["optimizers"]):
                if run.owners:  # a sharded optimizer keeps the state of this rank's weights only
                    params = [p for group in opt.param_groups for p in group["params"]]
                    opt_state["state"] = {i: entry for i, entry in opt_state["state"].items()
                                          if run.owners[id(params[i])] == run.rank}
                for group, saved_group in zip(opt.param_groups, opt_state["param_groups"]):
                    saved_group["initial_lr"] = group["initial_lr"]  # the flags' learning rates, not the saved ones
                opt.load_state_dict(opt_state)
            if run.ref_model not in (None, run.model):
                run.ref_model.load_state_dict(state["ref_model"])
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as e:
            raise CheckpointFileError(state_path, f"{state_path} is not this run's training state "
                                      f"({error_summary(e)})") from None
    except CheckpointFileError as e:
        unusable_checkpoint("--resume", e, saved)
    return step


def same_version(run_dir):
    """--resume: a run that another version of grpo.py wrote is refused in one line, before any work is done."""
    try:
        version = read_config(os.path.join(run_dir, "config.json")).get("version", 1)
    except (OSError, ValueError):  # resume says what is wrong with the file, or that there is nothing to resume
        return
    if version != VERSION:
        start = (glob.glob(os.path.join(run_dir, "chatrl_checkpoints", "*")) or [run_dir])[0]
        sys.exit(f"error: --resume: the run was written by grpo.py version {version}, this is version {VERSION}: "
                 f"finish it with the version that started it, or start a new run from its checkpoint: --init {start}")


def resumable(args, run_config, config, checkpoint_dir):
    """Stop with one line when the run cannot resume with these flags: changed inputs, or a flag that shapes the
    trajectory changed -> the flags that differ and may (step sizes, the spread)."""
    for name, digest in run_config["inputs"].items():
        if name in config["inputs"] and digest != config["inputs"][name]:  # a task watched no more: not checked
            kind, _, which = name.partition(":")
            flag = task_class(args.task).data_flags.get(name, "--task")
            sys.exit(f"error: --resume: the run's {INPUTS[kind].format(flag)}{which and ' '}{which} changed since it "
                     f"started (sha256 {str(digest)[:12]} then, {str(config['inputs'][name])[:12]} now): put the "
                     f"original back, or go on deliberately with a new run that starts from the checkpoint: --init "
                     f"{checkpoint_dir}")
    evaluating = bool(args.eval_only or args.ask)  # an evaluation reads the policy alone, and samples as it is told
    ignored = ("resumed_with", "inputs", "scores", "task_code") + flags_with("observes") + (
        flags_with("teacher") + flags_with("sampling") + flags_with("machine") + flags_with("episode") if evaluating
        else ())
    differing = sorted(k for k in {**run_config, **config} if k not in ignored and config.get(k) != run_config.get(k))
    refused = [k for k in differing if k not in flags_with("step-size") + flags_with("spread") + ("world_size",)]
    if "num_steps" in refused and not evaluating:  # the schedule ends at the run's last step: more steps are a new run
        steps, others = run_config.get("num_steps"), [k for k in refused if k != "num_steps"]
        way = (f"to train further, start a new run from its newest checkpoint (a fresh optimizer state and schedule): "
               f"--init {checkpoint_dir} --run-name <another> --num-steps <the steps to add>"
               if isinstance(steps, int) and args.num_steps > steps else
               f"resume with --num-steps {steps} and stop it where you like (a stop signal saves the step under way)")
        sys.exit(f"error: --resume --num-steps {args.num_steps}: the run's schedule is {steps} steps (its learning "
                 f"rate schedule ends there), and a resumed run keeps it; {way}"
                 + (f"; the run's flags differ in {', '.join(others)} too" if others else ""))
    if refused:  # e.g. a default that changed since the run started (reinforce's aggregation): name the old value
        original = as_flags({k: run_config.get(k) for k in refused if k in vars(args)})
        sys.exit(f"error: --resume with flags that differ from the run's ({', '.join(refused)}): "
                 f"pass the original flags{': ' + original if original else ''}")
    return differing


def read_config(path):
    """A run's config.json -> its dict; OSError, or ValueError for a file that is not one JSON object."""
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError("not a JSON object")
    return config


def read_step_log(path, log=print):
    """metrics.jsonl or samples.jsonl -> list of dicts. A last line cut short (a kill while appending) is dropped
    with a note; damage anywhere else is an error that names the line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    metrics = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("no step number")
        except ValueError as e:
            if n == len(lines):  # no newline after it: the write was cut off
                log(f"note: {path}: the last line is incomplete (a run killed while logging?); ignored")
                break
            raise ValueError(f"{path} line {n} is damaged ({e}): delete that line, or the file") from None
        metrics.append(row)
    return metrics


# -----------------------------------------------------------------------------
# Evaluation and --ask: greedy and sampled, every rank takes its share of the problems

def first_eval(args, run):
    """The eval of the step a run starts at (eval_every due there, or the last step's): step 0's, and on --resume one
    that a stop skipped (end_of_step saves first). Rank 0 read the metrics: every rank follows its answer."""
    final = run.start_step == args.num_steps
    if not args.eval_every or (run.start_step % args.eval_every and not final) or all_reduce(
            torch.tensor(float(run.start_evaluated)), dist.ReduceOp.MAX).item():
        return
    if run_eval(args, run, run.start_step, args.final_eval_examples if final else args.eval_examples) is None:
        raise KeyboardInterrupt(f"{stop_name()} during the eval of step {run.start_step}")


class Abandoned(Exception):
    """An eval left between two of its batches: a stop signal reached a rank during the steps (run_eval)."""


def run_eval(args, run, step, num_examples):
    """The eval at this step, into metrics.jsonl and evals/step_<step>.jsonl (--resume --eval-only: its own
    eval_only.jsonl and evals/eval_only_step_<step>.jsonl) -> the metrics, or None if a stop signal abandoned it."""
    run.model.eval()
    stop = stop_requested if STOP["at_step_end"] else None  # every rank, between eval batches
    label = "--eval-only" if args.eval_only else f"step {step} eval"

    def scores(model, task, of=""):  # -> (the metrics, this rank's greedy replies)
        return evaluate(model, run.tokenizer, task, num_examples, args, run.rank, run.world_size, run.autocast, stop,
                        label + of)
    try:
        result, replies = scores(run.model, run.test_task)
        for name, task in run.watched.items():  # --eval-task: does training on one task cost another?
            watched = scores(run.model, task, f", {name}")[0]
            result.update({f"eval_{name}_{k[len('eval_'):]}": v for k, v in watched.items()})
        if run.teacher is not None and step == 0:  # the teacher's own score: the ceiling a distilled student heads for
            with on_device(run.teacher, run.device, args.teacher_offload):
                taught = scores(run.teacher, run.test_task, ", the teacher")[0]
            result.update({f"teacher_{k}": v for k, v in taught.items()})
    except Abandoned:  # it only reads: the step is saved at once (end_of_step)
        run.log(f"step {step}: eval abandoned ({stop_name()}); --resume runs it")
        return None
    if run.world_size > 1:  # every greedy reply to rank 0, which writes them in problem order
        gathered = [None] * run.world_size if run.master else None
        dist.gather_object(replies, gathered, dst=0)
        replies = sorted((r for part in gathered for r in part), key=lambda r: r["index"]) if run.master else []
    own = args.eval_only and args.resume  # the run's checkpoint evaluated: a result that is not the training's
    if run.master and (run.writes or own):
        atomic_save("".join(json.dumps(r) + "\n" for r in replies).encode(),
                    os.path.join(run.run_dir, "evals", f"eval_only_step_{step}.jsonl" if own else f"step_{step}.jsonl"))
    if run.master and own:
        with writing(), open(os.path.join(run.run_dir, "eval_only.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **result}) + "\n")
    run.log((f"--eval-only, {policy_name(args, run)}: " if args.eval_only else f"step {step} eval: ")
            + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))
    record(run, {"step": step, **result})
    return result


def policy_name(args, run):  # the policy an evaluation reads, in words
    return (f"the run's policy at step {run.start_step}" if args.resume else "random weights (--init scratch: an "
            "untrained model; --init <run folder> evaluates a trained one)" if args.init == "scratch" else
            f"the policy of {run.model.start_checkpoint}")


def evaluation_settings(args):
    """The task and sampling an evaluation runs with, and where they come from, in words."""
    k = args.num_samples if args.ask else args.pass_k  # sampled replies a question
    sampled = f" and {k} sampled replies (--temperature {args.temperature} --top-k {args.top_k})" if k else ""
    count = "all" if args.final_eval_examples < 0 else args.final_eval_examples
    episode = {k: vars(args)[k] for k in flags_with("episode")}
    episodes = "" if ONE_TURN[0](args) else f", episodes of {as_flags(episode)}"
    settings = (("" if args.ask else f"{count} test problems of ") + f"task {args.task}, greedy{sampled} up to "
                f"{args.eval_max_new_tokens} tokens (--eval-max-new-tokens){episodes}")
    if args.run_settings is None:
        return settings + ": the flags'" + ("" if args.init == "scratch" else " (no run folder of this program around "
                                            "the checkpoint)")
    path, unlike = args.run_settings
    return settings + f": the run's ({path})" + "".join(
        f"; --{name.replace('_', '-')} {here} given here, the run's {then}" for name, (then, here) in unlike.items())


def ask(args, run):
    """--ask: the start policy's replies to one question, greedy then --num-samples sampled, graded when the question
    is one of the task's problems; the first lines name the policy and the settings. -> [(reply, reward or None)]."""
    task = run.train_task
    problems = (t[i] for t in (run.test_task, task) for i in range(min(len(t), 10_000)))  # a generated task's train
    found = [p for _, p in zip(range(2), (p for p in problems if args.ask.strip() == next(  # split can be endless:
        m["content"] for m in reversed(p["messages"]) if m["role"] == "user").strip()))]  # its first 10,000; 2 found
    known = found[0] if found else None
    reference = known["messages"][-1]["content"] if known else None  # a short text answer is shown (a game's digit)
    shown_answer = f" (its answer: {reference})" if isinstance(reference, str) and len(reference) <= 80 and (
        reference.isprintable()) else ""
    run.log(f"--ask, {policy_name(args, run)}: " + (f"graded as the task's problem{shown_answer}" if known else
                                                    f"not one of the task's problems ({args.task}): no grade"))
    run.log(f"--ask: {evaluation_settings(args)}")
    if len(found) > 1:  # a game's question is often the same for every problem, its hidden state apart
        run.log("note: --ask: several of the task's problems have this question; graded as the first found")
    for note in args.notes:
        run.log(f"note: {note}")
    prompt = run.tokenizer.render_for_completion({"messages": [{"role": "user", "content": args.ask}]})
    conversations = [known] if known else None  # an episode's task answers the problems of its own only
    with run.autocast:
        greedy = play(task, run.model, run.tokenizer, [prompt], conversations, 1, args.eval_max_new_tokens, args,
                      temperature=0)
        sampled = play(task, run.model, run.tokenizer, [prompt], conversations, args.num_samples,
                       args.eval_max_new_tokens, args, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    replies = []
    for label, samples, row in [("greedy", greedy, 0)] + [(f"sample {i + 1}", sampled, i)
                                                          for i in range(args.num_samples)]:
        conversation, text = graded(task, run.tokenizer, known, samples, row) if known else (
            None, reply_text(run.tokenizer, samples, row))
        reward = task.reward(conversation, text) if known else None
        replies.append((text, reward))
        for turn in episode_of(conversation or {}).get("episode", [])[:-1]:  # an episode: its turns, then the last
            run.log(f"[{label}, {turn['role']}] {turn['content']}")
        run.log(f"[{label}{'' if reward is None else f', reward {reward:g}'}] {text}")
    return replies


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


EVAL_BATCH = 32  # problems sampled in one generate call
PROGRESS_SECONDS = 30  # between two progress lines in a log file (a terminal's line is redrawn at every batch)


@torch.no_grad()
def evaluate(model, tokenizer, task, num_examples, args, rank, world_size, autocast, stop=None, label="eval"):
    """Greedy replies scored by the task (eval_reward, its eval metrics) and pass@1..k from --pass-k samples. Rank r
    takes problems r, r + world_size, ...; sums are reduced over ranks. stop: called by every rank before each batch
    (as often on each), raises Abandoned if so. label: the progress lines'. -> (metrics, this rank's greedy replies)"""
    n = len(task) if num_examples < 0 else min(num_examples, len(task))
    mine = list(range(rank, n, world_size))
    names = list(task.eval_metrics(task[0], ""))  # the task's metric names: the same for every reply
    totals = torch.zeros(2 + len(names) + args.pass_k, dtype=torch.float64)  # count, reward, metrics, pass@1..k
    replies, start, chunk, shown = [], time.time(), EVAL_BATCH, None  # shown: when the last progress line was
    rank0 = launched()[0] == 0
    for i in range(0, -(-n // world_size), chunk):
        if stop is not None and stop():
            raise Abandoned
        conversations = [task[j] for j in mine[i:i + chunk]]
        if not conversations:  # a rank with one problem fewer, at the last batch
            continue
        prompts = [tokenizer.render_for_completion(c) for c in conversations]
        with autocast:
            greedy = play(task, model, tokenizer, prompts, conversations, 1, args.eval_max_new_tokens, args,
                          temperature=0)
            sampled = play(task, model, tokenizer, prompts, conversations, args.pass_k, args.eval_max_new_tokens, args,
                           temperature=args.temperature, top_k=args.top_k,
                           seed=[args.seed + 7919 * j for j in mine[i:i + chunk]]) if args.pass_k else None
        for p, example in enumerate(conversations):
            conversation, reply = graded(task, tokenizer, example, greedy, p)
            reward, metrics = task.reward(conversation, reply), task.eval_metrics(conversation, reply)
            totals[:2 + len(names)] += torch.tensor([1, reward] + [metrics[k] for k in names], dtype=torch.float64)
            replies.append(dict(index=mine[i + p], question=conversation["messages"][0]["content"], reply=reply,
                                reward=reward, **metrics, length=greedy["lengths"][p].item(),
                                truncated=bool(greedy["truncated"][p]), **episode_of(conversation)))
            if sampled is not None:
                correct = sum(task.evaluate(*graded(task, tokenizer, example, sampled, p * args.pass_k + g))
                              for g in range(args.pass_k))
                totals[2 + len(names):] += torch.tensor([pass_at_k(args.pass_k, correct, k)
                                                         for k in range(1, args.pass_k + 1)])
        done, total, elapsed = min(i + chunk, len(mine)), len(mine), time.time() - start
        line = f"{label}: {done}/{total} problems ({elapsed:.0f}s, ~{elapsed / done * (total - done):.0f}s left)"
        if rank0 and sys.stdout.isatty():
            print(f"\r{line}", end="" if done < total else "\n", flush=True)
        elif rank0 and done < total and (shown is None or elapsed - shown >= PROGRESS_SECONDS):
            print(line, flush=True)
            shown = elapsed
    totals = all_reduce(totals)
    means = (totals / totals[0].clamp(min=1)).tolist()
    keys = ["eval_reward"] + [f"eval_{name}" for name in names] + [f"eval_pass@{k}" for k in range(1, args.pass_k + 1)]
    return {"eval_examples": int(totals[0]), **dict(zip(keys, means[1:]))}, replies


# -----------------------------------------------------------------------------
# Comparing runs: --compare, and the summary at the end of every run

COMPARE_HEADER = ["run", "task", "preset", "advantage", "seeds", "steps", "reward(last10)", "best reward", "first eval",
                  "eval", "best eval", "pass@1", "pass@k", "kl", "teacher kl", "clip frac", "reply len", "wall s",
                  "tok/s"]


def eval_score_key(config, watched=""):
    """The metric that ranks runs: of the trained task, or of a watched one (--eval-task) by its name."""
    return f"eval_{watched + '_' if watched else ''}{config['scores'][watched]}"


def compare_runs(run_dirs, plot_path):
    """Side-by-side table of finished runs, and their curves on shared axes when matplotlib is installed. Runs that
    differ only in --seed are one configuration: a row of mean ± std over its seeds, a mean curve with a ±std band."""
    seed_only = ("seed", "inputs") + flags_with("observes")  # what does not make a configuration
    configurations = {}  # the flags that make a configuration -> [(run_dir, config, metrics)], one per seed
    for run_dir in run_dirs:
        try:
            config = read_config(os.path.join(run_dir, "config.json"))
            metrics = read_step_log(os.path.join(run_dir, "metrics.jsonl"))
            if not ({"task", "algo"} <= set(config) and type(config.get("scores")) is dict and "" in config["scores"]):
                raise ValueError("config.json is not a nanogrpo run's configuration")
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested past Python's stack
            sys.exit(f"error: {run_dir} is not a finished run directory ({e})")
        if config.get("reward_combination") == "normalize-then-sum":  # GDPO's advantages: --advantage is idle
            config = dict(config, advantage="gdpo")
        key = json.dumps({k: v for k, v in config.items() if k not in seed_only}, sort_keys=True)
        if twin := next((d for d, c, _ in configurations.get(key, []) if c.get("seed") == config.get("seed")), None):
            print(f"note: {run_dir} ran the same configuration with the same seed as {twin}: shown as its own row")
            key += run_dir  # a copy, or a rerun: counting it as one more seed would shrink the std for nothing
        configurations.setdefault(key, []).append((run_dir, config, metrics))
    groups = list(configurations.values())
    configs = [seeds[0][1] for seeds in groups]
    names = [os.path.basename(os.path.normpath(seeds[0][0])) for seeds in groups]  # without the seed of several
    names = [re.sub(r"-seed\d+$", "", name) if len(seeds) > 1 else name for name, seeds in zip(names, groups)]
    clashes = {name for name in names if names.count(name) > 1}  # folders of the same name stay apart: add parent
    names = [os.path.join(os.path.basename(os.path.dirname(os.path.abspath(seeds[0][0]))), name) if name in clashes
             else name for name, seeds in zip(names, groups)]
    watched = list(dict.fromkeys(name for seeds in groups for _, c, _ in seeds for name in c.get("scores", {}) if name))
    episodes = sorted({k for seeds in groups for _, _, metrics in seeds for m in metrics for k in m  # a run's episodes:
                       if k == "episode_turns" or k.startswith("eval_correct@")},  # turns, correct@1..N (--attempts)
                      key=lambda k: (k != "episode_turns", len(k), k))
    own = sorted({k for seeds in groups for _, c, metrics in seeds for m in metrics for k in m  # the task's own eval
                  if k.startswith("eval_") and "@" not in k and k not in ("eval_examples", eval_score_key(c))  # metrics
                  and not any(k.startswith(f"eval_{name}_") for name in c.get("scores", {}) if name)})
    table = [COMPARE_HEADER + [k.removeprefix("eval_").replace("episode_turns", "turns") for k in episodes + own]
             + watched]  # a watched task's column: its eval score at the end
    for name, seeds, config in zip(names, groups, configs):
        per_seed = [run_summary(c, metrics, watched, episodes + own) for _, c, metrics in seeds]
        table.append([name, task_name(config["task"]), preset_of(config), config.get("advantage"), len(seeds)]
                     + [across_seeds(values) for values in zip(*per_seed)])
    widths = [max(len(fmt(row[i])) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(fmt(v).rjust(w) for v, w in zip(row, widths)))
    scores = {task_name(config["task"]): eval_score_key(config) for config in configs}
    print("first eval / eval = at the start / end of the run, greedy on held-out problems: "
          + ", ".join(f"{task} {key}" for task, key in scores.items())
          + "; pass@k from --pass-k samples; kl, teacher kl, reply len: the last step's; clip frac, tok/s: the "
          "mean over the steps; wall s: at the last step's end; a±b = mean ± std over the seeds"
          + ("; " + ", ".join(k.removeprefix("eval_") for k in own) + ": the task's own eval metrics at the end"
             if own else "")
          + ("; " + ", ".join(watched) + ": the watched tasks' eval score at the end" if watched else ""))
    if len(scores) > 1:
        print(f"note: these runs trained on {len(scores)} tasks ({', '.join(scores)}): their scores do not compare")
    dests = [a.dest for a in parser._actions if a.option_strings and a.dest not in seed_only]
    differ = [k for k in dict.fromkeys(dests) if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1]
    differing = [as_flags({k: c.get(k) for k in differ}) for c in configs]
    if any(differing):
        print("flags that differ between the rows (a flag left out: unset there; preset: the preset whose settings a "
              "run has, or custom):\n" + "\n".join(f"  {name.ljust(max(map(len, names)))}  {flags}"
                                                    for name, flags in zip(names, differing)))
    if plot_path:  # (--no-plot: none)
        plot_runs(names, groups, watched, episodes, own, plot_path)
    return table


def preset_of(config):
    """The preset whose algorithm flags a run ran with, whatever its --algo (reinforce with the ladder's four flags
    is grpo), its own --algo first where presets coincide; else "custom". Flags idle in the run are not compared."""
    run = SimpleNamespace(**{**dict.fromkeys(ROLES), **config})
    idle = {k for k in PRESETS["reinforce"] if any(holds(run) for holds, _ in IDLE[k])}
    # clip_eps_high None, as resolve_config sets it: the upper clip is the lower one
    presets = {name: dict(p, clip_eps_high=p["clip_eps_high"] or p["clip_eps"]) for name, p in PRESETS.items()}
    return next((name for name in sorted(presets, key=lambda name: name != config["algo"])
                 if all(k in idle or config.get(k) == v for k, v in presets[name].items())), "custom")


def metric_column(metrics, key):
    return [(m["step"], m[key]) for m in metrics if m.get(key) is not None]


def run_summary(config, metrics, watched=(), episodes=()):
    """One run's numbers in COMPARE_HEADER's order from "steps" on, then its last episode columns and watched scores."""
    train = [m for m in metrics if "reward" in m]
    last = train[-1] if train else {}
    evals = metric_column(metrics, eval_score_key(config))
    pass_k = sorted((int(k.split("@")[1]), k) for k in (metrics[-1] if metrics else {}) if k.startswith("eval_pass@"))
    logged = {key: [m[key] for m in train if m.get(key) is not None] for key in ("clip_frac", "tokens_per_s")}
    mean = {key: sum(v) / len(v) if v else None for key, v in logged.items()}  # over the steps that logged it
    return [len(train), sum(m["reward"] for m in train[-10:]) / len(train[-10:]) if train else None,
            max((m["reward"] for m in train), default=None),
            evals[0][1] if evals else None, evals[-1][1] if evals else None, max((v for _, v in evals), default=None),
            metrics[-1].get("eval_pass@1") if pass_k else None, metrics[-1].get(pass_k[-1][1]) if pass_k else None,
            last.get("kl"), last.get("teacher_kl"), mean["clip_frac"], last.get("reply_len"), last.get("wall_time"),
            mean["tokens_per_s"]] + [next((m[k] for m in reversed(metrics) if k in m), None) for k in episodes] + [
        (metric_column(metrics, eval_score_key(config, name)) or [(None, None)])[-1][1]
        if name in config.get("scores", {}) else None for name in watched]


def across_seeds(values):
    """One value, or (mean, std) over the seeds that have one."""
    values = [v for v in values if v is not None]
    if len(values) <= 1 or (len(set(values)) == 1 and isinstance(values[0], int)):  # e.g. every seed ran N steps
        return values[0] if values else None
    return (sum(values) / len(values), torch.tensor(values, dtype=torch.float64).std().item())


def fmt(value):  # a table cell: mean±std over seeds, a float, "-" for none
    return (f"{value[0]:.3f}±{value[1]:.3f}" if isinstance(value, tuple) else "-" if value is None
            else f"{value:.3f}" if isinstance(value, float) else str(value))


def plot_runs(names, configurations, watched, episodes, own, plot_path):
    """Train reward, eval score (dashed: the task's own eval metrics, the watched tasks'), KL where a run has one and
    reply length against step, and where runs have episodes their turns and eval correct@1..N: one colour per
    configuration, the mean over its seeds with a ±std band."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)")
        return
    kl = any(m.get(k) is not None for seeds in configurations for _, _, metrics in seeds for m in metrics
             for k in ("kl", "teacher_kl"))
    panels = [("reward", "train reward"), (None, "eval score")] + (
        [("kl", "KL to reference; dashed: to the teacher")] if kl else []) + [("reply_len", "reply length")]
    correct = [k for k in episodes if k.startswith("eval_correct@")]  # --attempts: eval correct within 1..N
    panels += [("episode_turns", "turns an episode")] if "episode_turns" in episodes else []
    panels += [(correct[0], f"eval correct@1 (solid) .. @{len(correct)} (dashed, k up: higher)")] if correct else []
    columns = 3 if len(panels) > 4 else 2
    fig, axes = plt.subplots(2, columns, figsize=(16 if columns == 3 else 11, 7), sharex=True)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (key, title) in zip(axes.flat, panels):
        extras = own + watched if key is None else ["teacher_kl"] if key == "kl" else correct[1:] if key in correct \
            else []
        for i, (name, seeds), task in ((i, run, task) for i, run in enumerate(zip(names, configurations))
                                       for task in [""] + extras):
            by_step = {}  # task: the trained one (""); dashed: a watched task's eval, the KL to the teacher, correct@k
            for _, config, metrics in seeds:
                if key is not None or task in own or task in config.get("scores", {"": None}):
                    column = (task or key) if key is not None or task in own else eval_score_key(config, task)
                    for step, value in metric_column(metrics, column):
                        by_step.setdefault(step, []).append(value)
            steps = [s for s in sorted(by_step) if len(by_step[s]) == len(seeds)]  # where every seed has a value
            if not steps:
                continue
            values = torch.tensor([by_step[s] for s in steps], dtype=torch.float64)  # [steps, seeds]
            mean = values.mean(dim=1)
            label = name + (f" ({len(seeds)} seeds, mean ± std)" if len(seeds) > 1 else "") + (task and f": {task}")
            ax.plot(steps, mean, label=label, color=f"C{i}", marker="o" if key is None or key in correct else None,
                    markersize=3, linestyle="--" if task else "-")
            if len(seeds) > 1:
                std = values.std(dim=1)
                ax.fill_between(steps, mean - std, mean + std, color=f"C{i}", alpha=0.2, linewidth=0)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0, 0].legend()
    if watched or own:
        axes[0, 1].legend(fontsize=7)
    for ax in axes.flat[len(panels) - columns:len(panels)]:  # the lowest panel of each column
        ax.set_xlabel("step")
        ax.tick_params(labelbottom=True)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)  # a long-lived process (the tests, a notebook) would otherwise keep every figure
    replaced = os.path.exists(plot_path)
    atomic_save(png.getvalue(), plot_path)
    print(f"plot: {plot_path}" + (" (replaced the one there)" if replaced else ""))


def run_script(argv=None):
    """`python grpo.py`: main, a one-line error in one write (Python's exit takes two): ranks' lines stay whole."""
    try:
        main(argv)
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        sys.stderr.write(f"{stop.code}\n")  # one write: stderr passes each write straight through
        sys.exit(1)


if __name__ == "__main__":
    run_script()
