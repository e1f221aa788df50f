"""A helper of tests/test_online_controller.py, run in its own process (VIS_MOE_ONLINE is read from the environment):
sequence 0 gets a long prompt, is removed (llama_memory_seq_rm), then sequence 1 is served; prints the anonymous
memory after the context was made, after the long prompt and after the removal (KiB), and saves the logits of
sequence 1's prompt and greedy steps.  argv: model, flash attention (0/1), logits output (.npy)."""
import json
import sys

import numpy as np

import pyvis  # noqa: F401  (points llama_cpp at our libraries)
import llama_cpp as L

WORDS = "the quick brown fox jumps over a lazy dog while experts route every token to a few of many".split()


def rss_anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return -1


def main():
    path, fa, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False
    model = L.llama_model_load_from_file(path.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 2048, 128, 128, 2
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = fa
    cp.kv_unified = True  # one stream: the removed sequence's cells lie among the other's
    ctx = L.llama_init_from_model(model, cp)
    assert model and ctx
    vocab = L.llama_model_get_vocab(model)
    nv = L.llama_vocab_n_tokens(vocab)
    b = L.llama_batch_init(128, 0, 1)
    rss = {"made": rss_anon()}

    def tokens(text):
        buf = (L.llama_token * 4096)()
        n = L.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 4096, True, False)
        return [buf[i] for i in range(n)]

    def decode(seq, toks, pos0, want_logits):
        rows = []
        for c in range(0, len(toks), 128):
            chunk = toks[c:c + 128]
            for i, t in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + c + i, 1, int(want_logits)
                b.seq_id[i][0] = seq
            b.n_tokens = len(chunk)
            assert L.llama_decode(ctx, b) == 0
            if want_logits:
                rows += [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), (nv,)).copy() for i in range(len(chunk))]
        return rows

    # sequence 1 first (a short prompt: its cells stay), then sequence 0's long prompt after it, removed
    short = tokens(" ".join(WORDS[(j * 3) % len(WORDS)] for j in range(40)))
    rows = decode(1, short, 0, True)
    decode(0, tokens(" ".join(WORDS[(j * 7) % len(WORDS)] for j in range(900))), 0, False)
    rss["long"] = rss_anon()
    assert L.llama_memory_seq_rm(L.llama_get_memory(ctx), 0, -1, -1)
    rss["removed"] = rss_anon()
    # sequence 1 goes on: its new cells land where sequence 0's were (zeros with the controller, stale without)
    pos = len(short)
    step = [int(np.argmax(rows[-1]))]
    for _ in range(24):
        rows += decode(1, step, pos, True)
        pos += 1
        step = [int(np.argmax(rows[-1]))]
    np.save(out, np.array(rows))
    print(json.dumps(rss))


if __name__ == "__main__":
    main()
