"""Opt-in apps that ship with reliable_jobs but stay out of a project until it lists them.

Each is a Django app of its own: add it to ``INSTALLED_APPS`` next to
``reliable_jobs`` to get its commands and tasks. Nothing in the core imports
them.
"""
