"""Demo tasks, pages and the `demo` command that exercise reliable_jobs end to end."""
