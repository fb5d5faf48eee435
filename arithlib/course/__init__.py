"""The teaching layer: the exercises\x27 checks, the course site and the class set-up."""
