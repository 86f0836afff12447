"""Every golden case (tests/golden/) through Client.attend against a real
server, once with numpy arrays and once with torch tensors; the multihead
cases' layers are written with attention_client.torch.export_model."""
import os
import tempfile
import unittest

import numpy as np
import torch

import attention_client
from attention_client.torch import export_model
from reference import golden_cases, golden_tensor
from server_fixture import Server

CASES = golden_cases()
_SCORE_PARAMS = ("w_q", "w_k", "w_v", "w")
_MASKS = ("valid_lens", "key_padding_mask", "attn_mask")


def write_repository(folder):
    for case in CASES:
        if case["kind"] != "multihead":
            continue
        m = case["multihead"]
        layer = torch.nn.MultiheadAttention(
            m["embed_dim"], m["num_heads"], bias=m.get("bias", True),
            add_bias_kv=m.get("add_bias_kv", False), add_zero_attn=m.get("add_zero_attn", False),
            kdim=m.get("kdim") or None, vdim=m.get("vdim") or None)
        layer.load_state_dict({k: torch.from_numpy(golden_tensor(t))
                               for k, t in m["state_dict"].items()})
        export_model(layer, os.path.join(folder, case["name"]))


def request_of(case, convert):
    """(query, key, value, fields) of a case, its tensors passed through `convert`."""
    inputs, options = case["inputs"], case["options"]
    q, k, v = (convert(golden_tensor(inputs[n])) if n in inputs else None
               for n in ("query", "key", "value"))
    fields = {"id": case["name"], "need_weights": options.get("need_weights", False),
              "average_weights": options.get("average_weights", False)}
    mask = options.get("mask", {})
    for name in _MASKS:
        if name in mask:
            fields[name] = convert(golden_tensor(mask[name]))
    fields["causal"] = mask.get("causal", "none")
    if case["kind"] == "multihead":
        fields["model"] = case["name"]
        if not case["multihead"]["batch_first"]:
            fields["layout"] = "sequence_first"
        return q, k, v, fields
    fields["score"] = options.get("score", "scaled_dot")
    for name in ("scale", "num_heads"):
        if name in options:
            fields[name] = options[name]
    params = options.get("score_params", {})
    for name in _SCORE_PARAMS:
        if name in params:
            fields[name] = convert(golden_tensor(params[name]))
    if "bandwidth" in params:
        fields["bandwidth"] = params["bandwidth"]
    return q, k, v, fields


def setUpModule():
    global repository, server, client
    repository = tempfile.TemporaryDirectory(prefix="attention_golden_models_")
    write_repository(repository.name)
    server = Server(repository.name)
    client = attention_client.Client(server.target, timeout=30)
    server.wait_serving(client)


def tearDownModule():
    client.close()
    server.stop()
    repository.cleanup()


class GoldenTest(unittest.TestCase):
    def assertMatches(self, case, got, name):
        want = golden_tensor(case["expected"][name]).astype(np.float64)
        tol = case["tolerance"]
        self.assertEqual(list(got.shape), list(want.shape), f"{case['name']} {name} shape")
        got = np.asarray(got, np.float64)
        bad = ~(np.abs(got - want) <= tol["atol"] + tol["rtol"] * np.abs(want))
        self.assertFalse(bad.any(), f"{case['name']} {name}: {bad.sum()} of {bad.size} elements "
                         f"off; first at {np.argwhere(bad)[:1].tolist()}")

    def check(self, case, answer, kind):
        self.assertEqual(answer.id, case["name"])
        self.assertIsInstance(answer.output, kind)
        self.assertMatches(case, answer.output if kind is np.ndarray else answer.output.numpy(),
                           "output")
        if "weights" in case["expected"]:
            self.assertIsInstance(answer.weights, kind)
            self.assertMatches(case, np.asarray(answer.weights), "weights")
        else:
            self.assertIsNone(answer.weights)

    def test_every_case_with_numpy_arrays(self):
        self.assertGreaterEqual(len(CASES), 29)
        for case in CASES:
            with self.subTest(case=case["name"]):
                q, k, v, fields = request_of(case, lambda a: a)
                self.check(case, client.attend(q, k, v, **fields), np.ndarray)

    def test_every_case_with_torch_tensors(self):
        for case in CASES:
            with self.subTest(case=case["name"]):
                q, k, v, fields = request_of(case, torch.from_numpy)
                self.check(case, client.attend(q, k, v, **fields), torch.Tensor)


if __name__ == "__main__":
    unittest.main()
