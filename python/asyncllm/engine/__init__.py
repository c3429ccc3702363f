"""The engine core: one step = schedule -> execute the model -> update from output."""
