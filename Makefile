# Shortcuts for course.py, which does the work (and needs nothing but Python >= 3.10).
.PHONY: setup lab test check bench slides site clean
setup:
	python3 course.py setup
lab:
	python3 course.py lab
test:
	python3 course.py test
check:
	python3 course.py check
bench:
	python3 course.py bench
slides:
	python3 course.py slides
site:
	python3 course.py site
clean:
	rm -rf .venv .pytest_cache build *.egg-info
