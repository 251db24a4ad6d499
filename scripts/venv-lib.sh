# Sourced by the setup scripts (not run): `venv_with_pip DIR` creates the virtual environment DIR with $PYTHON
# (default python3) unless it exists, and sets `pip` to its quiet pip command (an array: "${pip[@]}" install ...).
venv_with_pip() {
  if [ ! -x "$1/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$1"
  fi
  pip=("$1/bin/python" -m pip --disable-pip-version-check -q)
}
