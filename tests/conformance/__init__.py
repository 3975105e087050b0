"""The conformance suite: fxamp against torch.compile + torch.autocast on the patterns real
training code uses (tests/conformance/harness.py says how a case is judged)."""
