"""Driver side: the only run loop and the parts it is built from. Never imports Ray."""
