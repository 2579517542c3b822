"""One module per lesson, for what a lesson needs beyond the generic helpers: its exercise checker and
the arithmetic its checks share. Lesson 2's checker is `ddp_helpers.exercises`."""
