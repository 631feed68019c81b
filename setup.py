"Packaging for flexrt; metadata lives in settings.ini (nbdev's single source)."
from configparser import ConfigParser
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    author=cfg['author'],
    author_email=cfg['author_email'],
    license='Apache-2.0',
    url=cfg['git_url'],
    packages=setuptools.find_packages(include=['flexrt', 'flexrt.*']),
    python_requires='>=' + cfg['min_python'],
    install_requires=cfg['requirements'].split(),
    extras_require={
        'dev': cfg['dev_requirements'].split(),
        'bench': ['deepspeed'],
    },
    entry_points={'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
                  'console_scripts': ['flexrt=flexrt.autotuner.cli:main']},
    zip_safe=False,
)
