"""Diagnostic (prints, writes no result file): the acceptance rule's time per round for greedy
rows, the full rule on warp's one-hot distributions (`accept_batch`) against the argmax shortcut
(`accept_greedy`), demo vocabulary (8192), one torch thread, median ms of 200 calls, at a few
batch sizes and k; it also checks that both give the same outcomes. Made the figures in
verifier_service/acceptance.py's docstring and in commit f09d900:

    .venv/bin/python benchmarks/diagnostics/greedy_accept.py
"""
import torch, time, statistics
torch.set_num_threads(1)
from specserve.verifier.acceptance import accept_batch, accept_greedy
from specserve.core.sampling import warp, SamplingParams
def m(fn, n=200):
    for _ in range(10): fn()
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    return round(1e3*statistics.median(ts),3)
V=8192; g=SamplingParams()
for B,K in ((1,4),(1,0),(16,2),(32,1),(32,0)):
    logits=[torch.randn(K+1,V) for _ in range(B)]
    drafts=[[int(x) for x in torch.randint(0,V,(K,))] for _ in range(B)]
    full=lambda: accept_batch(drafts, [None]*B, [warp(l, g) for l in logits], [None]*B)
    fast=lambda: accept_greedy(drafts, logits)
    assert full()==fast()
    print(B,K, "general ms", m(full), "greedy ms", m(fast))
