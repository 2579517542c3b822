"""One module per lesson, for what a lesson needs beyond the generic helpers: its exercise checker and
the arithmetic its checks share (`lesson1`, `lesson2`)."""
