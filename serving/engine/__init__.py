"""The engine: its client interface, the in-process engine and its core process, scheduler, executor, output
processor, warm-up, stop text."""
