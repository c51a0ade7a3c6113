"""The training recipe for the bundled tiny-coder target and its DFlash drafter."""
