"""Installed under the plugin entry-point group but must never be imported unless named."""

raise RuntimeError("canary plugin imported")
