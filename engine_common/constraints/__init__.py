"""Structured-output constraints (JSON schema, regex, grammar, choice): validated at admission,
their nesting measured without recursion, JSON Schema $ref resolution."""
