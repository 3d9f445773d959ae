"""Prompt packs (docs/prompt-packs.md): the file format, where packs come from, their compiled questions, and
how answers become categories and a decision."""
