"""Speculative decoding: drafters behind one ``propose`` interface, acceptance on the device,
the draft-budget chooser and the settings (``speculative_config``)."""
