"""Tokenisation, bad-example handling, batch order and padding."""

import pytest
import torch

from atlas_core.train.data import collate, epoch_batches, render_chat, retained_indices, tokenize
from tests.train_fixtures import CharTokenizer


def test_response_only_targets():
    tok = CharTokenizer()
    data = tokenize(tok, [("ab", "xyz"), ("abcd", "q")], max_length=20)
    batch = collate(data, [0, 1], pad_id=0)
    assert batch.ids.shape == (2, 6)  # bos + 4 prompt chars + 1 response
    # row 0: [bos a b x y z]; positions 2,3,4 predict x, y, z
    assert batch.targets[0].tolist() == [-100, -100] + batch.ids[0, 3:6].tolist() + [-100]
    assert batch.targets[1].tolist() == [-100] * 4 + [batch.ids[1, 5].item(), -100]
    assert batch.mask[0].tolist() == [1] * 6 and batch.mask[1].tolist() == [1] * 6
    assert batch.num_targets == 4


def test_all_positions_for_kl_contexts():
    data = tokenize(CharTokenizer(), ["hello", "hi"], max_length=20)
    batch = collate(data, [0, 1], pad_id=0, all_positions=True)
    assert (batch.targets != -100).sum(1).tolist() == [6, 3]  # every real token, BOS included
    replay = collate(data, [0, 1], pad_id=0)
    assert (replay.targets != -100).sum(1).tolist() == [5, 2]  # LM loss on every text token after BOS


def test_bad_examples_raise_with_ids():
    records = [("p", "ok"), {"prompt": "p", "response": "", "id": "task-7"}, ("p", "x" * 50)]
    with pytest.raises(
        ValueError, match=r"2 bad example\(s\): #1 \(task-7\): empty response; #2 \(train\[2\]\): too long"
    ):
        tokenize(CharTokenizer(), records, max_length=10, name="train")


def test_skip_and_truncate_are_listed():
    records = [("p", "ok"), {"prompt": "p", "response": "", "id": "task-7"}, ("p", "x" * 50)]
    skipped = tokenize(CharTokenizer(), records, max_length=10, on_bad_example="skip")
    assert len(skipped) == 1 and [(i.id, i.action) for i in skipped.issues] == [
        ("task-7", "skipped"),
        ("data[2]", "skipped"),
    ]
    cut = tokenize(CharTokenizer(), records, max_length=10, on_bad_example="truncate")
    assert len(cut) == 2 and len(cut.ids[1]) == 10
    assert [i.action for i in cut.issues] == ["skipped", "truncated"]


def test_epoch_order_is_a_pure_function_and_pads_little():
    lengths = torch.randint(5, 200, (100,), generator=torch.Generator().manual_seed(0))
    a = epoch_batches(lengths, 8, seed=3, epoch=2)
    assert a == epoch_batches(lengths, 8, seed=3, epoch=2)
    assert a != epoch_batches(lengths, 8, seed=3, epoch=1) and a != epoch_batches(lengths, 8, seed=4, epoch=2)
    assert sorted(i for b in a for i in b) == list(range(100))

    def padding(batches):
        return sum(int(lengths[b].max()) * len(b) - int(lengths[b].sum()) for b in batches)

    assert padding(a) < 0.5 * padding(epoch_batches(lengths, 8, seed=3, epoch=2, bucket_batches=1))


def test_retained_stream_is_a_pure_function_and_covers_everything():
    got = [retained_indices(10, 4, seed=0, micro_step=s) for s in range(5)]  # 20 items = two passes
    flat = [i for b in got for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert retained_indices(10, 4, seed=0, micro_step=3) == got[3]


class ChatTok(CharTokenizer):
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def test_render_chat_splits_at_the_assistant_turn():
    prompt, response = render_chat(ChatTok(), "add 1", "def f(): pass")
    assert prompt == "<user>add 1</><assistant>" and response == "def f(): pass</>"
    assert render_chat(CharTokenizer(), "p", "r") == ("p", "r\x02")
