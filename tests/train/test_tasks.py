"""Tests of the accuracy experiment's task generators (tools/train/tasks.py): labels checked by
independent evaluators, lengths within the requested range, determinism from the seed."""
import os
import random
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "train"))
import tasks  # noqa: E402


def eval_listops_recursive(tokens):
    """A second, recursive-descent evaluator (the module's own is a stack machine)."""
    pos = 1 if tokens[0] == tasks.CLS else 0

    def expr(i):
        t = tokens[i]
        if tasks.DIGIT0 <= t < tasks.DIGIT0 + 10:
            return t - tasks.DIGIT0, i + 1
        op = tasks.OPS[t - tasks.OP0]
        i += 1
        args = []
        while tokens[i] != tasks.CLOSE:
            v, i = expr(i)
            args.append(v)
        if op == "MAX":
            v = max(args)
        elif op == "MIN":
            v = min(args)
        elif op == "MED":
            v = sorted(args)[len(args) // 2]
        else:
            v = sum(args) % 10
        return v, i + 1

    value, end = expr(pos)
    assert end == len(tokens), "trailing tokens"
    return value


class ListOpsTest(unittest.TestCase):
    def test_labels_match_two_independent_evaluators(self):
        split = tasks.listops(300, seed=5, min_len=32, max_len=300)
        for toks, label in zip(split.tokens, split.labels):
            self.assertEqual(eval_listops_recursive(toks), label)
            self.assertEqual(tasks.evaluate_listops(toks), label)

    def test_lengths_depth_and_vocabulary(self):
        split = tasks.listops(200, seed=6, min_len=100, max_len=400, max_depth=10)
        for toks in split.tokens:
            self.assertGreaterEqual(len(toks), 100)
            self.assertLessEqual(len(toks), 400)
            self.assertEqual(toks[0], tasks.CLS)
            self.assertTrue(all(0 < t < tasks.VOCAB for t in toks))
            depth = deepest = 0
            for t in toks:
                depth += 1 if tasks.OP0 <= t < tasks.OP0 + 4 else (-1 if t == tasks.CLOSE else 0)
                deepest = max(deepest, depth)
            self.assertLessEqual(deepest, 10)
            self.assertEqual(depth, 0)

    def test_long_sequences_beyond_1024_tokens(self):
        # LRA's ListOps goes to 2,000 tokens; lengths are drawn in [min_len, max_len] with labels intact.
        split = tasks.listops(20, seed=8, min_len=1024, max_len=2048)
        for toks, label in zip(split.tokens, split.labels):
            self.assertGreaterEqual(len(toks), 1024)
            self.assertLessEqual(len(toks), 2048)
            self.assertEqual(eval_listops_recursive(toks), label)

    def test_all_classes_occur_and_no_class_dominates(self):
        labels = tasks.listops(2000, seed=7, min_len=64, max_len=256).labels
        counts = [labels.count(c) for c in range(10)]
        self.assertTrue(all(c > 0 for c in counts), counts)
        self.assertLess(max(counts) / len(labels), 0.3, counts)  # LRA's ListOps: majority ~20%

    def test_seeded_and_splits_differ(self):
        a = tasks.listops(50, seed=9, min_len=32, max_len=128)
        b = tasks.listops(50, seed=9, min_len=32, max_len=128)
        self.assertEqual(a, b)
        train, val, test = tasks.make_splits("listops", 3, (100, 100, 100), 32, 128)
        self.assertFalse(set(map(tuple, train.tokens)) & set(map(tuple, test.tokens)))
        self.assertNotEqual(val.tokens, test.tokens)


class RecallTest(unittest.TestCase):
    def test_label_is_the_value_bound_to_the_query_key(self):
        split = tasks.associative_recall(300, seed=11, min_len=40, max_len=120)
        for toks, label in zip(split.tokens, split.labels):
            self.assertEqual(toks[0], tasks.CLS)
            self.assertTrue(all(tasks.RECALL0 <= t < tasks.VOCAB for t in toks[1:]))
            # Decoded here from the documented layout (17 + 11 key + slot), not with the module's helper.
            pairs = [divmod(t - 17, 11) for t in toks[1:-1]]
            keys = [k for k, _ in pairs]
            self.assertEqual(len(keys), len(set(keys)))  # distinct keys
            self.assertTrue(all(0 <= k < 1024 and 0 <= v < 10 for k, v in pairs))
            query, slot = divmod(toks[-1] - 17, 11)
            self.assertEqual(slot, 10)  # the query's value slot is "asked"
            self.assertEqual(dict(pairs)[query], label)
            self.assertEqual(tasks.recall_fields(toks[-1]), (query, slot))
            self.assertGreaterEqual(len(toks), 40)
            self.assertLessEqual(len(toks), 120)

    def test_query_position_and_values_are_spread(self):
        # The queried pair sits anywhere in the sequence, and labels are near uniform, so neither
        # position nor value frequencies answer the question.
        split = tasks.associative_recall(2000, seed=12, min_len=100, max_len=1100)
        where = []
        for toks in split.tokens:
            keys = [tasks.recall_fields(t)[0] for t in toks[1:-1]]
            where.append(keys.index(tasks.recall_fields(toks[-1])[0]) / len(keys))
        self.assertLess(min(where), 0.05)
        self.assertGreater(max(where), 0.95)
        counts = [split.labels.count(c) for c in range(10)]
        self.assertLess(max(counts) / len(split.labels), 0.15, counts)


if __name__ == "__main__":
    random.seed(0)
    unittest.main()
