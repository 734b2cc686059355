"""One module of checks per notebook: ``from course.checks import nb01 as check``."""
